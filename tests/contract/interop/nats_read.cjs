// Reads every message of a JetStream stream with nats.js (the NATS project's
// JavaScript client, not used by outbox-toolkit) and prints them as one JSON
// array: subject, sequence, headers (name -> values) and the body as text.
// Usage: node nats_read.cjs nats://127.0.0.1:4222 STREAM
"use strict";
const { connect } = require("nats");

async function main() {
  const [server, stream] = process.argv.slice(2);
  const nc = await connect({ servers: server });
  try {
    const jsm = await nc.jetstreamManager();
    const info = await jsm.streams.info(stream);
    const found = [];
    if (info.state.messages > 0) {
      for (let seq = info.state.first_seq; seq <= info.state.last_seq; seq++) {
        const m = await jsm.streams.getMessage(stream, { seq });
        const headers = {};
        if (m.header) {
          for (const [name, values] of m.header) headers[name] = values;
        }
        found.push({
          subject: m.subject,
          seq: m.seq,
          headers,
          data: new TextDecoder().decode(m.data),
        });
      }
    }
    process.stdout.write(JSON.stringify(found));
  } finally {
    await nc.close();
  }
}

main().catch((err) => {
  process.stderr.write(String(err && err.stack ? err.stack : err) + "\n");
  process.exit(1);
});
