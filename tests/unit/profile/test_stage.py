"""The profile stage end to end on a tiny model on CPU: harness reuse, OOM handling, the
idle guard inside the stage, outputs and the no-data-leak rule."""

import json
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import workflow_config
from probes.config import SCHEMA, fill_defaults, load_yaml
from probes.contracts import STAGE_OUTPUTS
from probes.io import read_provenance
from probes.profile.stage import OUTPUT_KEYS, PRICED_BY_REPLAY, run_profile
from probes.settings import WorkflowConfig
from probes.step.idle import CardBusyError, CardState, GpuProcess

CANARY = "CANARY-7f3a9c-DO-NOT-LEAK"
LENGTHS = [8, 16, 24]


@pytest.fixture(autouse=True)
def one_thread():
    # the stage tests time nothing; one thread keeps them quick beside other test processes
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def lengths_path(tmp_path):
    n = 30
    frame = pd.DataFrame(
        {
            "example_id": [f"{i:016x}" for i in range(n)],
            "source": [f"{CANARY} source {i % 3}" for i in range(n)],
            "status": ["OK"] * (n - 4) + ["EMPTY", "ERROR", "TRUNCATED", "OK"],
            "n_tokens": [4 + (i * 7) % 20 for i in range(n)],
            "n_loss_tokens": [2 + (i * 3) % 5 for i in range(n)],
        }
    )
    path = tmp_path / "lengths.parquet"
    frame.to_parquet(path)
    return path


def stage_config(**profile):
    """The profile and training sections of the tests' runs (schema-filled dicts, to change
    before `typed_config` makes the run's config of them)."""
    schema = load_yaml(SCHEMA)["properties"]
    base = {
        "device": "cpu",
        "cpu": {
            "lengths": LENGTHS,
            "warmup": 0,
            "repeats": 1,
            "kernel_steps": 1,
            "padding_batches": 3,
        },
        "ce_chunk_tokens": 8,
        "padding_draws": 16,
    }
    return {
        "profile": fill_defaults({**base, **profile}, schema["profile"]),
        "training": fill_defaults({"micro_batch_size": 2, "max_seq_len": 64}, schema["training"]),
    }


def typed_config(sections: dict) -> WorkflowConfig:
    """The workflow config run_profile takes: `sections` over the embedded default."""
    return workflow_config(**sections)


def outputs_in(directory: Path) -> dict[str, Path]:
    return {key: directory / Path(rel).name for key, rel in STAGE_OUTPUTS["profile"].items()}


def run(tmp_path, lengths_path, model_dir, **profile):
    out = outputs_in(tmp_path / "out")
    summary = run_profile(lengths_path, None, model_dir, out, typed_config(stage_config(**profile)))
    return out, summary


RECORDING_HARNESS = """
from pathlib import Path

import torch.nn.functional as F

from probes.step import reference_harness

CALLS = Path(__file__).with_name("calls.txt")


def discover_target_modules(model):
    # another choice of targets than the reference: the query projections only
    return [n for n, _ in model.named_modules() if n.endswith("q_proj")]


def compute_loss(model, batch):
    with CALLS.open("a") as handle:
        handle.write(f"{tuple(batch['input_ids'].shape)}\\n")
    # another loss: the stock full-logits path, not the reference's chunked CE
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                   position_ids=batch.get("position_ids")).logits.float()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                           ignore_index=-100)


apply_adapters = reference_harness.apply_adapters
"""


def control_checks(out) -> list[dict]:
    return json.loads(Path(out["control"]).read_text())["checks"]


def test_stage_calls_the_users_harness_for_every_timed_step(tmp_path, lengths_path, tiny_model_dir):
    harness_dir = tmp_path / "user"
    harness_dir.mkdir()
    harness_file = harness_dir / "train_harness.py"
    harness_file.write_text(textwrap.dedent(RECORDING_HARNESS))
    out, _ = run(tmp_path, lengths_path, tiny_model_dir, harness=str(harness_file))

    provenance = json.loads(out["provenance"].read_text())
    used = provenance["harness"]
    assert used["file"] == str(harness_file)
    assert used["functions"]["compute_loss"].endswith("compute_loss")
    assert "probes_user_harness" in used["functions"]["compute_loss"]
    assert all(name.endswith("q_proj") for name in used["target_modules"])
    assert len(used["target_modules"]) == 4
    # LoRA r=16 on 4 q_proj (64 -> 2*32): 4 * 16 * (64 + 64)
    assert provenance["trainable_params"] == 4 * 16 * (64 + 64)

    calls = (harness_dir / "calls.txt").read_text().splitlines()
    # scaling 3 x (0 warm-up + 1 repeat); the FLOP count: 1 step; the memory check: per length
    # one real step and one trace on fake tensors; padding: 3 batches x (padded 1 + one-by-one 2
    # + packed 1); kernel table: 1 warm-up + 1 profiled step. The CE probe times the head on
    # hidden states.
    assert len(calls) == 3 + 1 + 3 * 2 + 3 * 4 + 2
    assert calls[:3] == ["(2, 8)", "(2, 16)", "(2, 24)"]
    # the memory stage's prediction against the real peak of the same steps (issue 28)
    memory = next(c for c in control_checks(out) if c["name"] == "memory_real_steps")
    assert memory["passed"] and len(memory["rows"]) == 3, memory
    # the harness has no loss_from_hidden: the CE probe says whose chunked loss it timed
    ce = pd.read_parquet(out["ce"])
    assert "harness has none" in ce.loc[ce["variant"] == "loss_positions_chunked", "source"].item()
    # this harness computes every position's logits (no LM_HEAD_POSITIONS): MFU counts the head
    # on every token, and the FLOP counter agrees
    assert provenance["lm_head_positions"] == "all"
    control = json.loads(out["control"].read_text())
    flops = next(c for c in control["checks"] if c["name"] == "analytic_flops_match_flop_counter")
    assert flops["passed"] is True


def test_reference_run_writes_every_output_and_leaks_no_data(
    tmp_path, lengths_path, tiny_model_dir
):
    out, summary = run(tmp_path, lengths_path, tiny_model_dir)
    assert all(out[key].is_file() for key in OUTPUT_KEYS)

    scaling = pd.read_parquet(out["scaling"])
    assert scaling["seq_len"].tolist() == LENGTHS
    assert (scaling["status"] == "OK").all()
    assert {"time_s", "peak_mem_bytes", "quadratic_share", "mfu", "batch"} <= set(scaling)
    assert scaling["mfu"].isna().all()  # CPU: no peak known, said so in the provenance

    fit = pd.read_parquet(out["fit"])
    assert len(fit) == 1 and fit["n_points"].item() == 3 and fit["method"].item() == "exact"

    penalty = pd.read_parquet(out["padding_penalty"])
    assert penalty["variant"].tolist() == ["one_by_one", "packed"]
    assert penalty["longest"].max() <= max(LENGTHS)
    assert penalty["padded_time_s"].notna().all() and penalty["measured_penalty"].notna().all()
    assert (penalty["n_batches"] == 3).all() and (penalty["n_batches_ok"] == 3).all()
    assert (penalty["measured_penalty_min"] <= penalty["measured_penalty"]).all()
    assert (penalty["measured_penalty"] <= penalty["measured_penalty_max"]).all()
    assert all(len(v) == 3 for v in penalty["batch_measured_penalty"])
    # one by one: predicted from the fit; packed: a row of sum(n) tokens may lie beyond the
    # longest fitted length, and then there is no prediction, said so
    one_by_one, packed = penalty.iloc[0], penalty.iloc[1]
    assert pd.notna(one_by_one["predicted_penalty"]) and "c per row" in one_by_one["prediction"]
    assert pd.notna(packed["predicted_penalty"]) or packed["prediction"].startswith("none")
    # the batches come from the upper length band (p75-p95 of the training lengths that fit)
    lengths = pd.read_parquet(lengths_path)
    fits = lengths.loc[lengths["status"].isin(["OK", "TRUNCATED"]), "n_tokens"]
    fits = fits[fits <= max(LENGTHS)]
    drawn = [n for batch in penalty["batch_example_lengths"].iloc[0] for n in batch]
    assert min(drawn) >= fits.quantile(0.75) and max(drawn) <= fits.quantile(0.95)

    ce = pd.read_parquet(out["ce"])
    assert ce["variant"].tolist() == [
        "train_step",
        "all_positions_unchunked",
        "loss_positions_unchunked",
        "loss_positions_chunked",
    ]
    assert ce["positions"].tolist()[1:] == ["all", "loss", "loss"]
    assert ce["n_positions"].iloc[1] > ce["n_positions"].iloc[2] == ce["loss_tokens"].iloc[2]
    assert "harness.loss_from_hidden" in ce.loc[3, "source"]
    assert "reference_harness.loss_from_hidden" in ce.loc[3, "source"]

    kernels = pd.read_parquet(out["kernels"])
    assert set(kernels["device_type"]) == {"CPU"}
    assert kernels["share"].sum() == pytest.approx(1.0)
    assert kernels["kernel_sum_s"].iloc[0] <= kernels["wall_s"].iloc[0] * 1.01

    provenance = json.loads(out["provenance"].read_text())
    assert provenance["cpu_only"] is True
    assert provenance["device"]["type"] == "cpu"
    assert {"job_id", "cuda_visible_devices", "partition"} <= set(provenance["slurm"])
    assert provenance["harness"]["spec"] == "probes.reference_harness"
    assert "versions" in provenance and provenance["versions"]["torch"]
    assert "NaN" in provenance["peak_tflops_source"]
    assert provenance["lm_head_positions"] == "loss"
    assert "4 per parameter" in provenance["mfu_convention"]

    control = json.loads(out["control"].read_text())
    assert control["passed"] is True
    assert {c["name"] for c in control["checks"]} == {
        "scaling_fit_recovers_known_coefficients",
        "analytic_flops_match_flop_counter",
        "memory_real_steps",
        "kernel_sum_within_wall_time",
    }
    flops = control["observed"]["analytic_flops_match_flop_counter"]
    assert abs(flops["analytic_over_counted"] - 1.0) <= 0.15
    raw = out["raw"].read_text()
    assert "CPU-ONLY" in raw and "key_averages" in raw
    assert read_provenance(out["scaling"])["config_hash"]

    for path in out.values():
        assert CANARY.encode() not in path.read_bytes(), path


BLIND_HARNESS = """
from torch.utils._python_dispatch import _disable_current_modes

from probes.step import reference_harness

discover_target_modules = reference_harness.discover_target_modules


class HiddenLoss:
    # forward and backward both run with every dispatch mode popped, as a custom kernel or a
    # compiled region would: FlopCounterMode sees none of the step
    def __init__(self, loss):
        self.loss = loss

    def backward(self):
        with _disable_current_modes():
            self.loss.backward()


def compute_loss(model, batch):
    with _disable_current_modes():
        return HiddenLoss(reference_harness.compute_loss(model, batch))
"""


def test_harness_hidden_from_the_flop_counter_keeps_every_timing(
    tmp_path, lengths_path, tiny_model_dir
):
    harness = tmp_path / "blind_harness.py"
    harness.write_text(textwrap.dedent(BLIND_HARNESS))
    out, _ = run(tmp_path, lengths_path, tiny_model_dir, harness=str(harness))
    provenance = json.loads(out["provenance"].read_text())
    assert provenance["mfu_verified"] is False
    assert "cannot see it" in provenance["mfu_unverified_reason"]
    control = json.loads(out["control"].read_text())
    assert control["passed"] is True and control["mfu_verified"] is False
    flops = next(c for c in control["checks"] if c["name"] == "analytic_flops_match_flop_counter")
    assert flops["passed"] is False and flops["observed"]["counted_linear_flops"] == 0
    assert (pd.read_parquet(out["scaling"])["status"] == "OK").all()
    for key in ("padding_penalty", "ce", "kernels"):
        assert not pd.read_parquet(out[key]).empty


OOM_HARNESS = """
import torch

from probes.step import reference_harness

discover_target_modules = reference_harness.discover_target_modules


def compute_loss(model, batch):
    if batch["input_ids"].shape[-1] >= 24:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB (fake)")
    return reference_harness.compute_loss(model, batch)
"""


def test_out_of_memory_point_is_recorded_and_the_others_go_on(
    tmp_path, lengths_path, tiny_model_dir
):
    harness = tmp_path / "oom_harness.py"
    harness.write_text(textwrap.dedent(OOM_HARNESS))
    out, _ = run(tmp_path, lengths_path, tiny_model_dir, harness=str(harness))
    scaling = pd.read_parquet(out["scaling"]).set_index("seq_len")
    assert scaling.loc[24, "status"] == "OOM"
    assert scaling.loc[8, "status"] == "OK" and scaling.loc[16, "status"] == "OK"
    fit = pd.read_parquet(out["fit"])
    assert fit["method"].item() == "insufficient_points"
    assert fit["n_points"].item() == 2
    assert "needs >= 3" in fit["message"].item() and "24:OOM" in fit["message"].item()
    # later probes stay within the lengths that ran
    assert pd.read_parquet(out["padding_penalty"])["longest"].max() <= 16
    assert pd.read_parquet(out["ce"])["seq_len"].max() <= 16
    assert pd.read_parquet(out["kernels"])["seq_len"].max() <= 16


def test_busy_card_stops_the_stage_before_weights_load(
    tmp_path, lengths_path, tiny_model_dir, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    busy = CardState("0", "NVIDIA H200", 70000.0, 143771.0, 99.0, [GpuProcess(31337, "train", 1)])
    config = stage_config(device="cuda")
    config["profile"]["idle"].update(timeout_s=1, initial_backoff_s=0.5, max_backoff_s=0.5)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded on a busy card")

    monkeypatch.setattr("probes.profile.load.load_model", no_weights)
    out = outputs_in(tmp_path / "out")
    with pytest.raises(CardBusyError, match="pid 31337"):
        run_profile(
            lengths_path,
            None,
            tiny_model_dir,
            out,
            typed_config(config),
            card_probe=lambda i: busy,
            sleep=lambda s: None,
        )
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_one_usable_example_profiles_everything_but_the_padding_penalty(tmp_path, tiny_model_dir):
    one = pd.DataFrame(
        {"example_id": ["0" * 16], "source": ["s"], "status": ["OK"], "n_tokens": [12]}
    ).assign(n_loss_tokens=4)
    path = tmp_path / "one.parquet"
    one.to_parquet(path)
    out, _ = run(tmp_path, path, tiny_model_dir)
    penalty = pd.read_parquet(out["padding_penalty"])
    assert (penalty["status"] == "SKIPPED").all()
    assert "only 1 usable training example(s)" in penalty["pick"].iloc[0]
    assert "use more data" in penalty["pick"].iloc[0]
    assert (pd.read_parquet(out["scaling"])["status"] == "OK").all()
    assert not pd.read_parquet(out["ce"]).empty and not pd.read_parquet(out["kernels"]).empty


@pytest.mark.parametrize("kind", ["sft", "plain"])
def test_a_trainer_is_profiled_through_its_own_training_step(
    tmp_path, lengths_path, tiny_model_dir, kind
):
    """trainer.factory set: the scaling, penalty, FLOP and kernel probes time the trainer's own
    training_step (SFTTrainer with LoRA, a plain Trainer), and the provenance says which. Where
    the replay prices the trainer's step-level changes (padding-free among them), the penalty
    is not timed and says so (the SFTTrainer case); without them it is (the plain case)."""
    from trainer_factories import write_factory

    from conftest import chat_rows, write_jsonl

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    spec = write_factory(tmp_path, tiny_model_dir, data, kind, micro=2, max_length=64)
    config = stage_config()
    config["trainer"] = {"factory": spec}
    config["replay"] = {**config.get("replay", {}), "step_changes": kind == "sft"}
    out = outputs_in(tmp_path / "out")
    summary = run_profile(lengths_path, None, tiny_model_dir, out, typed_config(config))
    assert all(point["status"] == "OK" for point in summary["scaling"])
    penalty = pd.read_parquet(out["padding_penalty"])
    if kind == "sft":
        assert (penalty["status"] == "SKIPPED").all()
        assert (penalty["pick"] == PRICED_BY_REPLAY).all()
    else:
        assert (penalty["status"] == "OK").any(), penalty
    provenance = json.loads(Path(out["provenance"]).read_text())
    assert provenance["harness"]["kind"] == "trainer"
    assert provenance["harness"]["factory"]["spec"] == spec
    assert provenance["lm_head_positions"] == "all"  # the trainer's stock loss
    assert "trainer:" in Path(out["raw"]).read_text()
    # the trainer's own step predicted on fake tensors against its real peak (issue 28)
    memory = next(c for c in control_checks(out) if c["name"] == "memory_real_steps")
    assert memory["passed"] and len(memory["rows"]) == len(LENGTHS), memory
