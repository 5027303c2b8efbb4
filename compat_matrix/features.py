"""The feature table: every row of the matrix and the tests that decide it.

This module is the one place that maps guarantees to tests. Each
:class:`Feature` names a suite and a list of test patterns:

* ``test_claim_is_fast`` names a test function (every parametrisation of it:
  ``test_claim_is_fast[postgresql]`` and so on). An exact name is a promise:
  when the suite ran and no such test was reported, the cell says so instead
  of passing, so a renamed test cannot turn a row silently green.
* ``test_webhook_*`` is a wildcard (``*`` only); it may match nothing.
* ``test_*[rabbitmq]`` or ``test_guarantees_hold[ordered]`` also require the
  tokens in brackets among the test's parameter ids (``sqlite-ordered`` has the
  tokens ``sqlite`` and ``ordered``).

Patterns are matched against the function name and against the qualified name
(``TestMachine::runTest`` for tests in classes). Tests that no feature of
their suite maps land in that suite's "other tests" row, so nothing is hidden.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

CONTRACT = "contract"
BROKERS = "brokers"
PROPERTY = "property"
#: Suite names in run order.
SUITE_NAMES: tuple[str, ...] = (CONTRACT, BROKERS, PROPERTY)


@dataclass(frozen=True)
class Feature:
    """One row of the matrix: a guarantee and the tests that check it."""

    id: str
    title: str
    suite: str
    tests: tuple[str, ...]
    #: True for the generated "other tests" row of a suite.
    other: bool = False

    def matches(self, function: str, qualname: str, params: str) -> bool:
        """True when any of this feature's patterns matches the test."""
        return any(pattern_matches(p, function, qualname, params) for p in self.tests)

    def exact_names(self) -> list[str]:
        """The patterns without a wildcard: tests that must be reported."""
        return [p for p in self.tests if "*" not in p]


@lru_cache(maxsize=512)
def _compile(pattern: str) -> tuple[re.Pattern[str], frozenset[str]]:
    name, bracket, rest = pattern.partition("[")
    tokens = frozenset(t.strip() for t in rest.rstrip("]").split(",") if t.strip())
    if bracket and not tokens:
        raise ValueError(f"empty parameter list in test pattern {pattern!r}")
    regex = ".*".join(re.escape(part) for part in name.split("*"))
    return re.compile(regex), tokens


def pattern_matches(pattern: str, function: str, qualname: str, params: str) -> bool:
    """Whether ``pattern`` (see the module docstring) matches one test."""
    regex, tokens = _compile(pattern)
    if not (regex.fullmatch(function) or regex.fullmatch(qualname)):
        return False
    return tokens <= set(params.split("-"))


def other_feature(suite: str) -> Feature:
    """The catch-all row for tests of ``suite`` that no feature maps."""
    return Feature(f"{suite}.other", f"{suite}: other tests", suite, (), other=True)


def _f(id: str, title: str, suite: str, *tests: str) -> Feature:
    return Feature(id, title, suite, tests)


#: Every row, in display order. Edit here when tests are added or renamed.
FEATURES: tuple[Feature, ...] = (
    # -- the dialect contract (tests/contract/test_dialect_contract.py, test_cli.py)
    _f(
        "atomic",
        "committed event claimable, rolled back never",
        CONTRACT,
        "test_committed_event_is_claimable_rolled_back_never",
        "test_enqueue_never_commits_the_callers_transaction",
    ),
    _f("enqueue-session", "enqueue with a Session", CONTRACT, "test_enqueue_with_a_session"),
    _f(
        "enqueue-async",
        "enqueue async (AsyncConnection, AsyncSession)",
        CONTRACT,
        "test_enqueue_async",
    ),
    _f(
        "disjoint-claims",
        "disjoint claims without lock waits",
        CONTRACT,
        "test_two_relays_claim_disjoint_rows_without_waiting",
    ),
    _f(
        "claim-limit",
        "claim honours its limit, oldest first; delayed events wait",
        CONTRACT,
        "test_claim_never_exceeds_the_limit_and_returns_oldest_first",
        "test_delayed_event_is_not_claimed_before_its_time",
    ),
    _f(
        "fencing",
        "stale relay fenced after lease expiry",
        CONTRACT,
        "test_expired_lease_is_claimed_again_and_stale_writes_change_nothing",
        "test_expired_but_unclaimed_lease_can_still_be_settled_by_its_owner",
    ),
    _f(
        "reap-dead",
        "expired leases spend attempts, then dead",
        CONTRACT,
        "test_reap_makes_an_event_dead_once_its_attempts_are_spent",
    ),
    _f(
        "backoff",
        "backoff and dead after max_attempts",
        CONTRACT,
        "test_transient_failure_backs_off_then_dead_after_max_attempts",
    ),
    _f("reject", "reject is dead at once", CONTRACT, "test_reject_is_dead_at_once_with_its_error"),
    _f(
        "replay",
        "replay: dead back to pending",
        CONTRACT,
        "test_replay_returns_dead_events_to_pending",
    ),
    _f(
        "ordered-head",
        "ordered: head of key blocks its key",
        CONTRACT,
        "test_ordered_head_of_key_blocks_the_next_event_of_its_key",
        "test_ordered_relays_deliver_each_key_in_order",
    ),
    _f(
        "ordered-key-walk",
        "ordered: keys visited in turn; a key behind a deep backlog is reached",
        CONTRACT,
        "test_ordered_claims_visit_every_key_in_turn",
        "test_ordered_claim_reaches_a_key_behind_a_deep_backlog",
    ),
    _f(
        "ordered-open-claim",
        "ordered: head in an open claim blocks its key (row locks)",
        CONTRACT,
        "test_ordered_head_in_an_open_claim_still_blocks_its_key",
    ),
    _f(
        "ordered-dead-head",
        "ordered: dead head blocks (block_on_dead)",
        CONTRACT,
        "test_ordered_dead_head_blocks_its_key_unless_told_otherwise",
    ),
    _f(
        "release",
        "release on shutdown",
        CONTRACT,
        "test_release_returns_unpublished_claims_without_burning_an_attempt",
    ),
    _f(
        "cleanup",
        "cleanup only old sent rows; delete on send",
        CONTRACT,
        "test_cleanup_removes_only_old_sent_rows_in_batches",
        "test_delete_on_send_removes_the_row",
    ),
    _f(
        "status",
        "status: counts, age, dead topics",
        CONTRACT,
        "test_status_reports_counts_age_and_dead_topics",
    ),
    _f(
        "bad-input",
        "bad input refused, nothing written",
        CONTRACT,
        "test_unserialisable_payload_names_the_field_and_writes_nothing",
        "test_configuration_errors_are_named",
    ),
    _f(
        "cli",
        "CLI install/status/relay SIGTERM",
        CONTRACT,
        "test_install_is_idempotent_and_status_reports_json",
        "test_relay_sigterm_finishes_the_batch_in_flight_and_exits_0",
    ),
    _f(
        "cli-ops",
        "CLI replay/cleanup; bad configuration is one line",
        CONTRACT,
        "test_replay_and_cleanup_commands",
        "test_bad_configuration_is_one_clear_line",
    ),
    _f(
        "cli-masking",
        "CLI masks the password (URLs with one)",
        CONTRACT,
        "test_relay_once_masks_the_password",
    ),
    # -- end to end (tests/contract/test_end_to_end.py): relay process, real RabbitMQ
    _f(
        "e2e-delivery",
        "end to end: relay process delivers every committed event, per-key order",
        CONTRACT,
        "test_relay_process_delivers_every_committed_event_in_key_order",
    ),
    _f(
        "e2e-broker-outage",
        "end to end: relay retries while RabbitMQ is down, then delivers",
        CONTRACT,
        "test_relay_retries_while_rabbitmq_is_down_and_delivers_when_it_is_back",
    ),
    # -- the broker contract (tests/contract/test_brokers.py)
    _f("rabbitmq-contract", "RabbitMQ: broker contract", BROKERS, "test_*[rabbitmq]"),
    _f(
        "rabbitmq-mapping",
        "RabbitMQ: message properties, routing, CloudEvents",
        BROKERS,
        "test_rabbitmq_message_properties",
        "test_rabbitmq_routing_key_template",
        "test_rabbitmq_cloudevents_structured",
        "test_rabbitmq_cloudevents_binary",
        "test_rabbitmq_declares_its_exchange",
    ),
    _f(
        "rabbitmq-unroutable",
        "RabbitMQ: unroutable, unencodable, missing exchange",
        BROKERS,
        "test_rabbitmq_unroutable_retry_option",
        "test_rabbitmq_unroutable_reject_names_routing_key",
        "test_rabbitmq_unencodable_event_is_rejected_alone",
        "test_rabbitmq_passive_declare_of_missing_exchange_is_retry",
    ),
    _f(
        "rabbitmq-connection",
        "RabbitMQ: connection loss, confirm timeout, reconnect",
        BROKERS,
        "test_rabbitmq_confirm_timeout_retries_then_reconnects",
        "test_rabbitmq_connection_lost_mid_batch_is_retry",
        "test_rabbitmq_connection_lost_while_idle_is_noticed_before_publishing",
        "test_rabbitmq_reconnect_backoff_while_down",
        "test_rabbitmq_survives_server_heartbeat_timeout_while_idle",
    ),
    _f(
        "rabbitmq-confirms",
        "RabbitMQ: confirm book-keeping (acks, nacks, returns)",
        BROKERS,
        "test_multiple_ack_confirms_every_tag_up_to_it",
        "test_return_then_ack_is_not_ok",
        "test_return_with_unroutable_retry",
        "test_stale_and_duplicate_confirms_are_ignored",
    ),
    _f("webhook-contract", "webhook: broker contract", BROKERS, "test_*[webhook]"),
    _f(
        "webhook-envelope",
        "webhook: envelopes, signatures, status codes",
        BROKERS,
        "test_webhook_plain_envelope_and_headers",
        "test_webhook_cloudevents_envelope",
        "test_webhook_wrong_secret_is_rejected_by_receiver",
        "test_webhook_without_secret_sends_no_signature",
        "test_webhook_status_classification",
        "test_webhook_unencodable_event_is_rejected_alone",
    ),
    _f(
        "webhook-delivery",
        "webhook: timeouts, refused, concurrency, per-key order",
        BROKERS,
        "test_webhook_timeout_is_retry",
        "test_webhook_connection_refused_is_retry",
        "test_webhook_requests_run_concurrently_up_to_the_limit",
        "test_webhook_same_key_in_order_and_stops_after_failure",
    ),
    _f("memory-contract", "memory broker: broker contract", BROKERS, "test_*[memory]"),
    _f(
        "broker-registry",
        "broker registry, URL options, option validation",
        BROKERS,
        "test_registry_creates_each_broker",
        "test_rabbitmq_url_options",
        "test_bad_options_raise_configuration_error",
    ),
    # -- the property suite (tests/property)
    _f(
        "property-unordered",
        "property: guarantees hold, random interleavings",
        PROPERTY,
        "test_guarantees_hold[unordered]",
    ),
    _f(
        "property-ordered",
        "property: guarantees hold, ordered mode",
        PROPERTY,
        "test_guarantees_hold[ordered]",
    ),
    _f(
        "property-finds-order-bug",
        "property: catches a missing head-of-key check",
        PROPERTY,
        "test_finds_missing_head_of_key_check",
    ),
    _f(
        "property-finds-lock-bug",
        "property: catches claims without SKIP LOCKED",
        PROPERTY,
        "test_finds_claims_without_skip_locked",
    ),
)


def features_for(suites: list[str] | tuple[str, ...]) -> list[Feature]:
    """The mapped features of ``suites``, in display order."""
    return [f for f in FEATURES if f.suite in suites]


def _check_table() -> None:
    seen: set[str] = set()
    for feature in FEATURES:
        if feature.id in seen:
            raise ValueError(f"duplicate feature id {feature.id!r}")
        if feature.suite not in SUITE_NAMES:
            raise ValueError(f"feature {feature.id!r}: unknown suite {feature.suite!r}")
        if not feature.tests:
            raise ValueError(f"feature {feature.id!r} maps no test")
        for pattern in feature.tests:
            _compile(pattern)
        seen.add(feature.id)


_check_table()
