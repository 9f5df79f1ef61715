"""Every call into the user's harness is guarded: a failure names profile.harness, the function,
the batch shape and the harness's own line; a loss backward cannot use is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from probes.step.harness import HarnessCallError, load_harness

HEADER = "import torch\ndef discover_target_modules(model):\n    return ['q_proj']\n"


def _harness(tmp_path: Path, compute_loss_body: str):
    path = tmp_path / "my_harness.py"
    path.write_text(HEADER + "def compute_loss(model, batch):\n" + compute_loss_body)
    return load_harness(str(path))


def _batch() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8)}


def test_compute_loss_raising_names_the_function_shape_and_line(tmp_path):
    harness = _harness(tmp_path, "    scale = 0\n    return batch['labels'].sum() / scale.bit\n")
    with pytest.raises(HarnessCallError) as caught:
        harness.compute_loss(None, _batch())
    message = str(caught.value)
    assert message.startswith(f"profile.harness '{tmp_path / 'my_harness.py'}': compute_loss()")
    assert "AttributeError" in message and "my_harness.py:6 (return batch" in message
    assert "batch shape input_ids 2x8, labels 2x8" in message


def test_loss_without_grad_is_named_as_the_harness_return(tmp_path):
    harness = _harness(tmp_path, "    return batch['labels'].sum()\n")
    with pytest.raises(HarnessCallError, match=r"compute_loss\(\) returned a tensor that does not"):
        harness.compute_loss(None, _batch())
    with torch.no_grad():  # where no backward follows, no grad is needed
        harness.compute_loss(None, _batch())


def test_loss_that_is_not_a_tensor_is_refused(tmp_path):
    harness = _harness(tmp_path, "    return {'loss': 1.0}\n")
    with pytest.raises(HarnessCallError, match="returned dict, not a loss tensor"):
        harness.compute_loss(None, _batch())


def test_out_of_memory_passes_through_for_the_per_length_record(tmp_path):
    harness = _harness(
        tmp_path, "    raise RuntimeError('CUDA out of memory. Tried to allocate')\n"
    )
    with pytest.raises(RuntimeError, match="out of memory") as caught:
        harness.compute_loss(None, _batch())
    assert not isinstance(caught.value, HarnessCallError)


def test_discover_target_modules_raising_is_named(tmp_path):
    path = tmp_path / "h.py"
    path.write_text(
        "def discover_target_modules(model):\n    return model.missing\n"
        "def compute_loss(model, batch):\n    return None\n"
    )
    with pytest.raises(
        HarnessCallError, match=r"discover_target_modules\(\) raised AttributeError"
    ):
        load_harness(str(path)).discover_target_modules(object())


def test_user_files_import_apart_with_their_siblings_and_leave_sys_path_alone(tmp_path):
    import sys

    from probes.step.harness import import_user_file

    before = list(sys.path)
    modules = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"sibling_{folder}.py").write_text(f"VALUE = {folder!r}\n")
        (tmp_path / folder / "train.py").write_text(f"from sibling_{folder} import VALUE\n")
        modules.append(import_user_file(tmp_path / folder / "train.py", "probes_test_"))
    assert [m.VALUE for m in modules] == ["a", "b"]  # same file name, two modules
    assert modules[0].__name__ != modules[1].__name__
    assert all(sys.modules[m.__name__] is m for m in modules)
    assert sys.path == before

    raising = tmp_path / "raising.py"
    raising.write_text("raise ValueError('at import')\n")
    with pytest.raises(ValueError, match="at import"):
        import_user_file(raising, "probes_test_")
    assert not [
        name for name, m in sys.modules.items() if getattr(m, "__file__", None) == str(raising)
    ]
    assert sys.path == before
