"""The kernel sets a user may name (`--kernels`), without importing torch: the serve config
checks a spec at load, before any worker starts. `engine.kernels.OPS` holds the candidates
themselves, in the same order (simplest first), and asserts that they match these names.
"""

from __future__ import annotations

NAMES: dict[str, tuple[str, ...]] = {
    "decode_attention": ("sdpa", "matmul", "paged", "paged-dpbf16"),
    "prefill_attention": (
        "sdpa",
        "blocked",
        "sdpa-aligned",
        "blocked-aligned",
        "flash",
        "flash-f32",
        "flash-dpbf16",
    ),
    "projections": ("plain", "packed", "brgemm"),
    "norm": ("torch", "fused"),
    "rope_kv": ("torch", "fused"),
}
"""Each op's candidates by name, simplest first."""

HELP = (
    "auto: time each op's candidates on this machine at the model's shapes and take the "
    "fastest (cached under ~/.cache/pdserve/kernels); reference: torch's own kernels; or "
    "OP=NAME,... to fix some ops (the rest measured): "
    + "; ".join(f"{op}: {'|'.join(names)}" for op, names in NAMES.items())
)


def parse_spec(spec: str) -> dict[str, str] | None:
    """``auto`` -> {} (measure every op); ``reference`` -> None (the simplest candidate of
    every op); ``op=name,...`` -> those ops fixed. ValueError names the bad part."""
    spec = spec.strip()
    if spec in ("", "auto"):
        return {}
    if spec == "reference":
        return None
    fixed = {}
    for part in spec.split(","):
        op, sep, name = part.strip().partition("=")
        if not sep or op not in NAMES:
            raise ValueError(
                f"kernels={spec!r}: {part.strip()!r} is not auto, reference or OP=NAME with OP "
                f"one of {list(NAMES)}"
            )
        if name not in NAMES[op]:
            raise ValueError(f"kernels={spec!r}: {op} has no kernel {name!r} ({list(NAMES[op])})")
        fixed[op] = name
    return fixed
