"""The data_parallel stage: real data-parallel steps of random batching and the recommended
strategy under ``torchrun --nproc_per_node W``, against the prediction from one-process timings.

Runs only when ``training.world_size > 1`` (the rule is left out of the DAG otherwise; the report
says "world_size 1"). gloo on CPU (one thread per rank), NCCL on CUDA. Where ``trainer.factory``
or ``trainer.command`` is set, each rank builds the user's trainer and runs it as it trains, once
per ``data_parallel.sharding`` (DDP, FSDP2: one torchrun each), its micro-batches those its own
distributed dataloader yields (``probes.dp.trainer``); else each rank runs the harness on its
shard (``probes.dp.shard``, accelerate's sharding) of the bucket stage's plans, under DDP.
``probes.dp.worker`` measures, ``probes.dp.predict`` predicts and decomposes. A rank that dies, or
a launch that fails, is one ProbeError naming the rank and its last error line; nothing is
written then.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from probes.batching import plans as pl
from probes.contracts import LENGTH_GROUPED, RANDOM, STAGE_OUTPUTS
from probes.dp import predict, shard
from probes.dp.sharding import DDP, FSDP2, SHARDINGS, fsdp_config
from probes.errors import ProbeError
from probes.io import read_json, run_metadata
from probes.settings import WorkflowConfig
from probes.stage import all_or_nothing
from probes.step.load import factory_of

LOG = logging.getLogger("probes.dp")
OUTPUT_KEYS = tuple(STAGE_OUTPUTS["data_parallel"])
WORKER = "probes.dp.worker"  # run by torchrun as a module (`-m`), from SCRIPTS_DIR
SCRIPTS_DIR = Path(__file__).resolve().parents[2]


class DataParallelError(ProbeError, RuntimeError):
    """The data-parallel job cannot run or a rank failed; nothing was written."""


def backend_for(requested: str, device_type: str) -> str:
    """auto: NCCL on CUDA, gloo on CPU."""
    if requested != "auto":
        return requested
    return "nccl" if device_type == "cuda" else "gloo"


def measured_strategies(plans: pd.DataFrame) -> list[str]:
    """random and length grouping at the recommended bucket size (the plans' length_grouped):
    padded micro-batches both, which the worker builds."""
    return [s for s in (RANDOM, LENGTH_GROUPED) if s in set(plans["strategy"])]


def strategy_units(plans: pd.DataFrame, strategy: str, cap: int | None) -> tuple[list, list]:
    """The strategy's examples (lengths, loss tokens) in its single-process order, each length
    capped at `cap` when given (a CPU run)."""
    rows = plans[plans["strategy"] == strategy].sort_values("micro_batch_index")
    lengths = [int(v) for row in rows["example_lengths"] for v in row]
    loss = [int(v) for row in rows["example_loss_tokens"] for v in row]
    if cap:
        lengths = [min(v, cap) for v in lengths]
        loss = [min(lo, max(v - 1, 0)) for lo, v in zip(loss, lengths, strict=True)]
    return lengths, loss


def job_strategies(
    plans: pd.DataFrame,
    strategies: list[str],
    micro: int,
    grad_accum: int,
    world: int,
    n_steps: int,
    cap: int | None,
) -> tuple[dict[str, Any], dict[str, list[int]], dict[str, int]]:
    """Per strategy: job[rank][sampled step][k] = {"lengths", "loss"}; the sampled step indices;
    the epoch's optimizer steps."""
    job, indices, total = {}, {}, {}
    for name in strategies:
        lengths, loss = strategy_units(plans, name, cap)
        plan = shard.rank_plans(len(lengths), micro, grad_accum, world)
        total[name] = shard.common_steps(plan)
        indices[name] = shard.sample_steps(total[name], n_steps)
        by_length, by_loss = shard.map_plan(plan, lengths), shard.map_plan(plan, loss)
        job[name] = [
            [
                [
                    {"lengths": a, "loss": b}
                    for a, b in zip(by_length[r][s], by_loss[r][s], strict=True)
                ]
                for s in indices[name]
            ]
            for r in range(world)
        ]
    return job, indices, total


def launch(job: dict[str, Any], world: int, threads: int, timeout_s: float) -> list[dict]:
    """torchrun the worker; every rank's result, or DataParallelError naming the failed rank."""
    out = Path(job["out_dir"])
    job_path = out / "job.json"
    job_path.write_text(json.dumps(job))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        "-m",
        WORKER,
        str(job_path),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(SCRIPTS_DIR), os.environ.get("PYTHONPATH")])
        ),
    }
    LOG.info("launching %s", " ".join(command[2:]))
    try:
        returncode, stderr_tail = run_streaming(command, env, timeout_s)
    except subprocess.TimeoutExpired as error:
        raise DataParallelError(
            f"data_parallel: torchrun with {world} ranks did not finish within "
            f"data_parallel.timeout_s={timeout_s:.0f} s; raise it or sample fewer steps "
            "(data_parallel.steps). No output written."
        ) from error
    # in the order the ranks failed: the first is the cause
    failed = sorted(out.glob("rank*.error"), key=lambda p: p.stat().st_mtime_ns)
    errors = [(int(p.stem.removeprefix("rank")), p.read_text()) for p in failed]
    results = [out / f"rank{r}.json" for r in range(world)]
    if returncode != 0 or errors or not all(p.is_file() for p in results):
        raise DataParallelError(predict.failed_rank_message(errors, returncode, stderr_tail, world))
    return [json.loads(p.read_text()) for p in results]


PROGRESS_PREFIX = "data_parallel "  # probes.dp.worker.progress's bar


def progress_only(text: str, write: Callable[[str], object]) -> str:
    """Write the complete segments of `text` (ended by a newline or a tqdm carriage return)
    that are the progress bar's, and return the unfinished rest: whatever else the user's
    trainer writes to stderr (a warning quoting an example, say) is not echoed."""
    start = 0
    for end, char in enumerate(text):
        if char in "\r\n":
            if text.startswith(PROGRESS_PREFIX, start):
                write(text[start : end + 1])
            start = end + 1
    return text[start:]


def run_streaming(
    command: list[str], env: Mapping[str, str], timeout_s: float, keep: int = 4000
) -> tuple[int, str]:
    """Run `command`, passing rank 0's progress bar through from its stderr as it comes (a
    trainer rank's steps take minutes on a CPU; nothing else of the user's code is echoed:
    progress_only) and keeping the last `keep` characters for the error message; (return code,
    that tail). Raises subprocess.TimeoutExpired after `timeout_s`."""
    import threading

    tail: list[str] = []
    with subprocess.Popen(
        command, env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as process:

        def pump() -> None:
            assert process.stderr is not None
            pending = ""
            for chunk in iter(lambda: process.stderr.read(256), ""):
                pending = progress_only(pending + chunk, sys.stderr.write)
                tail.append(chunk)
                if len(tail) > 64:
                    del tail[: len(tail) - 64]

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        reader.join(timeout=10)
    return returncode, "".join(tail)[-keep:]


def summarise(
    records: pd.DataFrame, strategies: list[str], tolerance: float
) -> dict[str, dict[str, Any]]:
    out = {}
    for name in strategies:
        rows = records[records["strategy"] == name]
        optimizer_s = float(statistics.median(rows["optimizer_s"]))
        out[name] = predict.strategy_summary(rows.to_dict("records"), optimizer_s, tolerance)
    if RANDOM in out:
        for values in out.values():
            # the same sampled steps' share: real and predicted savings against random
            values["real_saving_vs_random_per_step"] = predict.saving(
                out[RANDOM]["real_s"] / out[RANDOM]["steps_measured"],
                values["real_s"] / values["steps_measured"],
            )
            values["predicted_saving_vs_random_per_step"] = predict.saving(
                out[RANDOM]["predicted_s"] / out[RANDOM]["steps_measured"],
                values["predicted_s"] / values["steps_measured"],
            )
    return out


def shardings_for(requested: tuple[str, ...], trainer: str | None) -> tuple[list, dict]:
    """(the shardings measured, {sharding: why not}): FSDP2 runs the trainer's own FSDP2 and
    needs a trainer; the harness is measured under DDP."""
    unknown = [s for s in requested if s not in SHARDINGS]
    if unknown or not requested:
        raise DataParallelError(
            f"data_parallel.sharding {list(requested)}: give one or more of {list(SHARDINGS)}."
        )
    if trainer:
        return list(dict.fromkeys(requested)), {}
    skipped = {
        s: "FSDP2 is measured on the user's trainer (set trainer.factory or trainer.command)"
        for s in requested
        if s == FSDP2
    }
    return [DDP], skipped


@dataclass(frozen=True)
class Launch:
    """Where and how the ranks run: W, the device and backend, the dtype and why, the CPU length
    cap and threads per rank, the trainer (None: the harness), the shardings measured and
    those not measured with why."""

    world: int
    device_type: str
    backend: str
    dtype: str
    dtype_reason: str
    cap: int | None
    threads: int
    trainer: str | None  # the trainer's factory spec or command; None: the harness
    shardings: tuple[str, ...]
    not_measured: dict[str, str]

    @property
    def cpu_only(self) -> bool:
        return self.device_type != "cuda"


def resolve_launch(cfg: WorkflowConfig) -> Launch:
    """The launch from the config, checked before anything loads: W > 1, a device, a machine
    that can host W ranks of the backend."""
    from probes.distributed import check_launch
    from probes.step.dtype import resolve_dtype
    from probes.step.runner import resolve_device

    dp_cfg, profile = cfg.data_parallel, cfg.profile
    world = int(cfg.training.world_size)
    if world < 2:
        raise DataParallelError(
            f"data_parallel: training.world_size is {world}; the stage measures data-parallel "
            "steps and runs only with training.world_size > 1."
        )
    try:
        device = resolve_device(profile.device, profile.allow_cpu)
    except ProbeError as error:
        raise DataParallelError(f"data_parallel: {error}") from error
    trainer = factory_of(cfg.trainer)
    shardings, not_measured = shardings_for(tuple(dp_cfg.sharding), trainer)
    for name, why in not_measured.items():
        LOG.warning("data_parallel: %s not measured: %s", name, why)
    cpu_only = device.type != "cuda"
    backend = backend_for(dp_cfg.backend, device.type)
    check_launch(world, backend)
    dtype, dtype_reason = resolve_dtype(profile.dtype, device.type)
    return Launch(
        world=world,
        device_type=device.type,
        backend=backend,
        dtype=dtype,
        dtype_reason=dtype_reason,
        cap=int(dp_cfg.cpu.max_seq_len) if cpu_only else None,
        threads=int(dp_cfg.cpu.threads_per_rank) if cpu_only else 1,
        trainer=trainer,
        shardings=tuple(shardings),
        not_measured=not_measured,
    )


def worker_job(out_dir: str, model_path: str, cfg: WorkflowConfig, setup: Launch) -> dict[str, Any]:
    """What every rank reads whichever step it runs (probes.dp.worker)."""
    from probes.step.runner import harness_section  # torch: only when a job is written

    dp_cfg = cfg.data_parallel
    return {
        "out_dir": out_dir,
        "model_path": model_path,
        "profile": harness_section(cfg.profile),
        "dtype": setup.dtype,
        "dtype_reason": setup.dtype_reason,
        "device_type": setup.device_type,
        "backend": setup.backend,
        "threads_per_rank": setup.threads,
        "timeout_s": float(dp_cfg.timeout_s),
        "seed": int(dp_cfg.seed),
        "rounds": int(dp_cfg.rounds),
        "warmup_rounds": int(dp_cfg.warmup_rounds),
    }


def harness_plans(
    plans: pd.DataFrame, strategies: list[str], cfg: WorkflowConfig, setup: Launch
) -> dict[str, Any]:
    """The harness's job: each rank's shard of each strategy's sampled steps."""
    training = cfg.training
    job_plans, indices, total = job_strategies(
        plans,
        strategies,
        int(training.micro_batch_size),
        int(training.grad_accum),
        setup.world,
        int(cfg.data_parallel.steps),
        setup.cap,
    )
    return {"strategies": job_plans, "step_indices": indices, "epoch_steps": total}


def trainer_plans(
    strategies: list[str],
    bucket_size: int | None,
    cfg: WorkflowConfig,
    setup: Launch,
    sharding: str,
) -> dict[str, Any]:
    """The trainer's job: each rank builds it and takes its own micro-batches."""
    return {
        "trainer": {
            "section": dict(cfg.raw["trainer"]),
            "sharding": sharding,
            "fsdp_config": fsdp_config() if sharding == FSDP2 else None,
            "strategies": strategies,
            "bucket_size_batches": int(bucket_size or 1),
            "n_steps": int(cfg.data_parallel.steps),
            "cap": setup.cap,
        }
    }


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    """The stage's entry (probes.stage.main): model directory from the tokenizer input."""
    started = time.perf_counter()
    setup = resolve_launch(cfg)
    plans = pl.read_plans(inputs["plans"])
    strategies = measured_strategies(plans)
    bucket_size = pl.recommended_bucket_size(read_json(inputs["recommendation"]))
    model_path = str(Path(inputs["tokenizer"][0]).parent)
    LOG.info(
        "data_parallel: W=%d %s on %s, %s, strategies %s, shardings %s",
        setup.world, setup.backend, setup.device_type, setup.trainer or "the harness",
        strategies, setup.shardings,
    )  # fmt: skip
    results = {}
    for sharding in setup.shardings:
        with tempfile.TemporaryDirectory(prefix="probes-dp-") as tmp:
            job = worker_job(tmp, model_path, cfg, setup)
            if setup.trainer:
                job.update(trainer_plans(strategies, bucket_size, cfg, setup, sharding))
            else:
                job.update(harness_plans(plans, strategies, cfg, setup))
            results[sharding] = launch(
                job, setup.world, setup.threads, float(cfg.data_parallel.timeout_s)
            )
    records = pd.DataFrame(
        predict.derive_wait([r for rs in results.values() for res in rs for r in res["records"]])
    )
    summary = summary_of(records, results, setup, cfg, bucket_size)
    summary["wall_s"] = time.perf_counter() - started
    write_outputs(outputs, records, summary, cfg, setup)


def summary_of(
    records: pd.DataFrame,
    results: dict[str, list[dict]],
    setup: Launch,
    cfg: WorkflowConfig,
    bucket_size: int | None,
) -> dict[str, Any]:
    """summary.json: per sharding and strategy real against predicted, where each rank ran."""
    tolerance = float(cfg.data_parallel.tolerance)
    first = next(iter(results.values()))
    return {
        "world_size": setup.world,
        "backend": setup.backend,
        "device_type": setup.device_type,
        "cpu_only": setup.cpu_only,
        "dtype": setup.dtype,
        "dtype_reason": setup.dtype_reason,
        "threads_per_rank": setup.threads,
        "max_seq_len_measured": setup.cap or int(cfg.training.max_seq_len),
        "tolerance": tolerance,
        "rounds": int(cfg.data_parallel.rounds),
        "bucket_size_batches": bucket_size,
        "sampled_steps": {
            name: sorted({int(v) for v in rows["step"]})
            for name, rows in records[records["sharding"] == setup.shardings[0]].groupby("strategy")
        },
        "runs": {
            sharding: summarise(
                records[records["sharding"] == sharding],
                strategies_of(records, sharding),
                tolerance,
            )
            for sharding in setup.shardings
        },
        "not_measured": setup.not_measured,
        "ranks": [result["where"] for result in first],
        "wrapped": {s: [r["where"] for r in rs] for s, rs in results.items()},
        "timed_step": first[0]["timed_step"],
        "prediction": (
            "max over ranks of one-process micro-batch time + optimizer + collective (DDP: the "
            "all-reduce timed by a hook; FSDP2: the smallest residual over the ranks)"
        ),
    }


def strategies_of(records: pd.DataFrame, sharding: str) -> list[str]:
    present = set(records.loc[records["sharding"] == sharding, "strategy"])
    return [s for s in (RANDOM, LENGTH_GROUPED) if s in present]


def write_outputs(
    outputs: Mapping[str, str],
    records: pd.DataFrame,
    summary: dict[str, Any],
    cfg: WorkflowConfig,
    setup: Launch,
) -> None:
    """steps.parquet (with the run's provenance) and summary.json, all or nothing."""
    provenance = {
        **run_metadata(dict(cfg.raw)),  # the validated config the provenance hashes
        "world_size": setup.world,
        "backend": setup.backend,
        "shardings": list(setup.shardings),
        "timed_step": setup.trainer or f"profile.harness {cfg.profile.harness}",
    }
    with all_or_nothing({key: outputs[key] for key in OUTPUT_KEYS}) as out:
        out.parquet("steps", records, provenance)
        out.json("summary", summary)
    LOG.info(
        "data_parallel: %s",
        {
            (sharding, k): (round(v["real_s"], 3), round(v["predicted_s"], 3), round(v["ratio"], 3))
            for sharding, run in summary["runs"].items()
            for k, v in run.items()
        },
    )
