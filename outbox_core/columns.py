"""Column maps: which column of a team's own outbox table holds each of the toolkit's fields.

``outbox install --columns`` adopts such a table; every command then reads it
through the map (:class:`ColumnMap`), SQL naming the table's columns and
Python code the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from outbox_core.errors import ConfigurationError
from outbox_core.identifiers import validate_identifier

#: The fields an existing table may hold in columns of its own names (``--columns``).
MAPPABLE_FIELDS = ("id", "event_id", "topic", "key", "payload", "headers", "created_at")
#: The auto-numbered column ``outbox install --columns`` adds when the table's ``id``
#: holds something else (Debezium's layout: ``id`` is the event's UUID).
ADDED_ID_COLUMN = "outbox_seq"


@dataclass(frozen=True)
class ColumnMap:
    """Which column of the outbox table holds each of the toolkit's fields.

    The default is the toolkit's own layout. An existing table (Debezium's
    outbox layout, say: ``id uuid``, ``aggregate_id``, ``event_type``,
    ``payload``) is relayed as it is with
    ``ColumnMap.parse("event_id=id,key=aggregate_id,topic=event_type")``:
    SQL names those columns, Python code keeps the field names
    (``table.c.key`` is the ``aggregate_id`` column). The bookkeeping
    columns (``state``, ``attempts``, ``available_at``, leases,
    ``key_partition``...) keep their names; ``outbox install`` adds them.

    ``id`` is the auto-numbered column that orders the table; when another
    field takes the name ``id`` and ``id`` is not mapped, it is
    ``outbox_seq``, which ``outbox install`` adds.
    """

    id: str = "id"
    event_id: str = "event_id"
    topic: str = "topic"
    key: str = "key"
    payload: str = "payload"
    headers: str = "headers"
    created_at: str = "created_at"

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for field in MAPPABLE_FIELDS:
            column = validate_identifier(getattr(self, field), f"column name of {field}")
            if column.lower() in BOOKKEEPING_COLUMNS:
                raise ConfigurationError(
                    f"columns: {field}={column} names a column the toolkit keeps for itself "
                    f"({', '.join(sorted(BOOKKEEPING_COLUMNS))})"
                )
            if column.lower() in seen:
                raise ConfigurationError(
                    f"columns: {seen[column.lower()]} and {field} both name column {column}"
                )
            seen[column.lower()] = field

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any] | ColumnMap | None) -> ColumnMap:
        """A map from ``event_id=id,key=aggregate_id,...`` (or a mapping of the same).

        Fields left out keep their own names; ``id`` becomes ``outbox_seq``
        when another field takes the name ``id``.
        """
        if isinstance(spec, ColumnMap):
            return spec
        if spec is None or spec == "":
            return cls()
        pairs: dict[str, Any] = {}
        if isinstance(spec, str):
            for part in spec.split(","):
                field, eq, column = part.strip().partition("=")
                if not eq or not field.strip() or not column.strip():
                    raise ConfigurationError(
                        f"columns: {part.strip()!r} is not FIELD=COLUMN "
                        "(e.g. event_id=id,key=aggregate_id,topic=event_type)"
                    )
                pairs[field.strip()] = column.strip()
        elif isinstance(spec, Mapping):
            pairs = dict(spec)
        else:
            raise ConfigurationError(
                "columns: expected FIELD=COLUMN pairs or a table of them, "
                f"not {type(spec).__name__}"
            )
        unknown = sorted(set(pairs) - set(MAPPABLE_FIELDS))
        if unknown:
            raise ConfigurationError(
                f"columns: unknown field(s) {', '.join(unknown)}; the fields are "
                f"{', '.join(MAPPABLE_FIELDS)}"
            )
        for field, column in pairs.items():
            if not isinstance(column, str):
                raise ConfigurationError(f"columns: {field} must name a column, not {column!r}")
        if "id" not in pairs and any(str(c).lower() == "id" for c in pairs.values()):
            pairs["id"] = ADDED_ID_COLUMN
        return cls(**pairs)

    @property
    def is_default(self) -> bool:
        """The toolkit's own layout (every field in its own column)."""
        return self == ColumnMap()

    def mapped(self) -> dict[str, str]:
        """``{field: column}`` of the fields held under another name."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.name
        }

    def __str__(self) -> str:
        """``event_id=id,key=aggregate_id,...``: what :meth:`parse` reads back.

        ``id=outbox_seq`` is left out where :meth:`parse` implies it.
        """
        mapped = self.mapped()
        if mapped.get("id") == ADDED_ID_COLUMN and "id" in {c.lower() for c in mapped.values()}:
            del mapped["id"]
        return ",".join(f"{field}={column}" for field, column in mapped.items())


#: Columns the toolkit writes itself, under these names in every layout.
BOOKKEEPING_COLUMNS = frozenset(
    {
        "state",
        "attempts",
        "available_at",
        "lease_owner",
        "lease_until",
        "sent_at",
        "last_error",
        "key_partition",
    }
)
