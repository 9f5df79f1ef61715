"""JSON files: the keys each must have (the report reads them); every control's keys."""

from __future__ import annotations

CONTROL_KEYS = ("name", "description", "expected", "observed", "passed")
# JSON outputs and the keys the report reads (a not-run stage may carry only status + reason).
JSONS: dict[str, tuple[str, tuple[str, ...]]] = {
    # also "implementations" (probes.mask.implementations): per attention implementation its
    # verdict, read by the replay (padding-free is priced only where it passed); not required
    # here: the report does not read it, and a gate without it clears no padding-free change
    "mask_gate": ("mask", ("passed", "confirm", "target")),
    "bucket_recommendation": ("bucket", ("status", "recommended", "thresholds")),
    # dtype/dtype_reason: probes.step.dtype; mfu_convention: probes.profile.flops.MFU_CONVENTION
    "profile_provenance": (
        "profile",
        ("device", "cpu_only", "harness", "dtype", "dtype_reason", "mfu_convention"),
    ),
    "mask_control": ("mask", CONTROL_KEYS),
    "padding_control": ("padding", CONTROL_KEYS),
    "bucket_control": ("bucket", CONTROL_KEYS),
    "profile_control": ("profile", CONTROL_KEYS),
    # the synthetic busy-wait harness: savings within 5%, a, b, c within 10%; plus "coverage"
    # (the intervals' coverage control), "instrument" (CV of repeated identical micro-batches)
    # and "stopping" (why the timing stopped)
    "replay_control": ("replay", CONTROL_KEYS),
    # what realize checked and its verdicts; {"status": "not_run", "reason": ...} when it did not
    "realize_summary": ("realize", ("status", "verdicts")),
    # the virtual-clock harness of known cost: epoch time and optimizer phase within 5%
    "realize_control": ("realize", CONTROL_KEYS),
    # per sharding and strategy (runs) real vs predicted, communication share, straggler wait;
    # where each rank ran
    "data_parallel_summary": (
        "data_parallel",
        ("world_size", "backend", "runs", "ranks", "tolerance"),
    ),
    "memory_summary": ("memory", ("target_gib", "target", "dtype", "gradient_checkpointing")),
    # a peak known by construction, real CPU steps within ±memory.tolerance, the check failing
    # a prediction without the optimizer state (probes.memory.control)
    "memory_control": ("memory", CONTROL_KEYS),
}
