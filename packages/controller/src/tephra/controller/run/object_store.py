"""Ray's object store, as an operator watches it per step: the bytes it holds and the bytes it
has spilled to disk, over every node of the cluster (what `ray memory --stats-only` prints)."""

from __future__ import annotations

import logging

import ray

from tephra.controller.run.memory_metrics import GIB

logger = logging.getLogger(__name__)
_warned: list[str] = []


def object_store_metrics() -> dict[str, float]:
    """`memory/object_store_used_gib` (held now, all nodes) and
    `memory/object_store_spilled_gib` (spilled since the cluster started), read from Ray's GCS;
    {} without a Ray session. Ray has no public call for these numbers: this is the one its
    `ray memory` command makes, so a Ray that moves it costs the metric (a warning, once), never
    the run."""
    if not ray.is_initialized():
        return {}
    try:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
        stats = reply.store_stats
        return {
            "memory/object_store_used_gib": stats.object_store_bytes_used / GIB,
            "memory/object_store_spilled_gib": stats.spilled_bytes_total / GIB,
        }
    except Exception as exc:  # noqa: BLE001  (a metric, not a reason to stop the run)
        if not _warned:
            _warned.append(repr(exc))
            logger.warning(
                "memory/object_store_* not logged: Ray %s did not answer its memory summary (%r)",
                ray.__version__,
                exc,
            )
        return {}
