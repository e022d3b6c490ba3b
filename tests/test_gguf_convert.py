"""Converting a GGUF file to bfloat16 safetensors one tensor at a time (flyspec/gguf_convert.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flyspec import assets

SMOL = "smollm2-135m-instruct"

# Run in a fresh interpreter, and reset the peak resident size before converting. Before the baseline it
# pays what every way of converting pays, whatever the model's size: importing the model code and
# parsing the GGUF's metadata (its tokenizer fields are hundreds of thousands of small arrays). What
# grows after that is memory that follows the weights.
_CHILD = """
import sys
from pathlib import Path
import torch, transformers
from gguf import GGUFReader
from flyspec.gguf_convert import convert_weights

gguf, out, how = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
with torch.device("meta"):
    transformers.AutoModelForCausalLM.from_config(config)
GGUFReader(gguf)
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # Linux: the peak resident size (VmHWM) starts again from the current size


def status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


before = status("VmRSS")
if how == "streamed":
    convert_weights(gguf, out)
else:
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
print(status("VmHWM") - before)
"""


def _convert(gguf: Path, out: Path, how: str) -> int:
    """Convert `gguf` into `out` in a subprocess ("streamed": flyspec's way; "transformers":
    from_pretrained then save_pretrained); returns how many bytes its peak resident memory grew."""
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(gguf), str(out), how],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_streamed_conversion_writes_transformers_bytes_in_a_fraction_of_the_memory(tmp_path: Path) -> None:
    """Proves that converting SmolLM2's GGUF streams its tensors: the conversion's peak resident memory
    grows by less than the bfloat16 weights it writes (269 MB; about 155 MB measured: the GGUF's parsed
    header and one slice of rows), while transformers' from_pretrained + save_pretrained, which
    `flyspec models prepare` used before, grows by more (about 830 MB: every tensor dequantised to
    float32, then the whole model; 11.1 GB for the 1.5B). And that streaming changes nothing:
    model.safetensors, config.json and generation_config.json are byte for byte what transformers
    writes."""
    (gguf,) = assets.source_files(assets.ZOO[SMOL])
    streamed = _convert(gguf, tmp_path / "streamed", "streamed")
    reference = _convert(gguf, tmp_path / "transformers", "transformers")
    weights = (tmp_path / "streamed" / "model.safetensors").stat().st_size
    assert streamed < weights < reference, (streamed, weights, reference)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        ours, theirs = tmp_path / "streamed" / name, tmp_path / "transformers" / name
        assert ours.read_bytes() == theirs.read_bytes(), name
