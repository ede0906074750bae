"""Build the embedded demo models: a small Llama target and a tiny draft, from nothing.

    python -m demo.build [--force] [--home DIR] [--seed N] [--threads N]

Generates the support-desk corpus, trains the tokenizer and both models on CPU (about three
minutes on two idle cores), evaluates them, and writes `<home>/models/demo` and
`<home>/models/demo-draft` as Hugging Face directories (config.json,
generation_config.json, model.safetensors, tokenizer files, `firstlight_demo.json`).

Skips the work when both directories hold a complete build of the same recipe version and
seed (their manifests share one `build_id`). Everything is written under a temporary
directory beside the targets and renamed into place, so an interrupted build never leaves
a half model; a lock file serialises concurrent builds.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from demo import corpus as corpus_mod
from demo.evaluate import EvalReport, evaluate
from demo.paths import DEMO_MODELS, MANIFEST, firstlight_home
from demo.tokenizer import encode_chats, save_tokenizer, special_ids, train_tokenizer
from demo.train import ModelSpec, TokenStream, TrainResult, train_model

RECIPE_VERSION = 3  # bump whenever anything below changes what gets built
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


@dataclass(frozen=True, slots=True)
class Recipe:
    """Everything that determines the built models, besides the code of the corpus."""

    seed: int = 0
    conversations: int = 12000
    vocab_size: int = 1024
    max_positions: int = 2048
    heldout: int = 64
    target: ModelSpec = field(
        # 192-token windows: a tool conversation (tools, question, call, result, reply) is
        # about 170 tokens, and 128 cut off the result and the reply that uses it.
        default_factory=lambda: ModelSpec("demo", 256, 688, 4, 8, 4, steps=300, seq_len=192)
    )
    draft: ModelSpec = field(
        default_factory=lambda: ModelSpec("demo-draft", 128, 344, 1, 4, 2, steps=450)
    )


def read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_built(home: Path, seed: int) -> bool:
    """Both models complete, from one build of this recipe version and `seed`."""
    build_ids = set()
    for name in DEMO_MODELS:
        directory = home / "models" / name
        manifest = read_manifest(directory)
        if manifest is None or any(not (directory / f).is_file() for f in REQUIRED_FILES):
            return False
        if manifest.get("recipe_version") != RECIPE_VERSION or manifest.get("seed") != seed:
            return False
        build_ids.add(manifest.get("build_id"))
    return len(build_ids) == 1


@contextmanager
def _locked(models: Path) -> Iterator[None]:
    models.mkdir(parents=True, exist_ok=True)
    with open(models / ".demo-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _save(result: TrainResult, tokenizer: Any, directory: Path) -> None:
    from transformers import GenerationConfig

    ids = special_ids(tokenizer)
    result.model.generation_config = GenerationConfig(
        bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|end|>"], pad_token_id=ids["<|pad|>"]
    )
    result.model.save_pretrained(str(directory), safe_serialization=True)
    save_tokenizer(tokenizer, directory)
    # Spell the config the pre-v5 way too, for loaders that read `rope_theta`/`torch_dtype`.
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = getattr(result.model.config, "rope_parameters", None) or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    config.setdefault("torch_dtype", "float32")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for file in directory.iterdir():
        file.chmod(0o644)


def _train_stats(spec: ModelSpec, result: TrainResult) -> dict[str, Any]:
    params = sum(p.numel() for p in result.model.parameters())
    return {
        "spec": asdict(spec),
        "parameters": params,
        "final_loss": round(result.final_loss, 4),
        "first_loss": round(result.losses[0], 4),
        "seconds": round(result.seconds, 1),
    }


def _install(staging: Path, models: Path) -> None:
    """Move each staged model into place: old directory aside, new one in, old one deleted."""
    for name in DEMO_MODELS:
        dest = models / name
        if dest.exists():
            dest.rename(staging / f"old-{name}")
        (staging / name).rename(dest)


def build(
    home: Path | None = None,
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
    recipe: Recipe | None = None,
) -> dict[str, Any]:
    """Build (or find up to date) both demo models; returns the manifest.

    `recipe` replaces the default recipe (its seed is set to `seed`); tests pass a tiny one.
    """
    home = home or firstlight_home()
    models = home / "models"
    with _locked(models):
        if not force and is_built(home, seed):
            manifest = read_manifest(models / "demo")
            assert manifest is not None
            return manifest
        staging = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=models))
        try:
            manifest = _build_into(staging, replace(recipe or Recipe(), seed=seed), progress)
            _install(staging, models)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _build_into(staging: Path, recipe: Recipe, progress: bool) -> dict[str, Any]:
    start = time.perf_counter()
    say = print if progress else (lambda *a, **k: None)
    convs = corpus_mod.build_corpus(recipe.seed, recipe.conversations)
    tokenizer = train_tokenizer(
        (t.content for c in convs for t in c.turns), recipe.vocab_size, recipe.max_positions
    )
    encoded = encode_chats(tokenizer, [[(t.role, t.content) for t in c.turns] for c in convs])
    stream = TokenStream.pack(encoded)
    seen = corpus_mod.user_messages(convs)
    say(
        f"demo corpus: {len(convs)} conversations, {len(seen)} distinct user messages, "
        f"{len(stream)} tokens"
    )
    ids = special_ids(tokenizer)
    results: dict[str, TrainResult] = {}
    for offset, (name, spec) in enumerate(_specs(recipe)):
        config = spec.llama_config(len(tokenizer), ids, recipe.max_positions)
        results[name] = train_model(spec, stream, config, recipe.seed + offset, progress)
    target, draft = results["demo"].model, results["demo-draft"].model
    heldout = corpus_mod.heldout_prompts(recipe.seed, recipe.heldout, seen)
    report = evaluate(target, draft, tokenizer, heldout, corpus_mod.SHOWCASE_PROMPTS)
    manifest: dict[str, Any] = {
        "recipe_version": RECIPE_VERSION,
        "seed": recipe.seed,
        "build_id": uuid.uuid4().hex,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "corpus": {
            "conversations": len(convs),
            "distinct_user_messages": len(seen),
            "tokens": len(stream),
        },
        "train": {name: _train_stats(s, results[name]) for name, s in _specs(recipe)},
        "eval": report.as_dict(),
        "wall_seconds": round(time.perf_counter() - start, 1),
    }
    for name in DEMO_MODELS:
        directory = staging / name
        _save(results[name], tokenizer, directory)
        role = {"demo": "target", "demo-draft": "draft"}[name]
        text = json.dumps({**manifest, "name": name, "role": role}, indent=2)
        (directory / MANIFEST).write_text(text + "\n")
    say(_summary(manifest, report))
    return manifest


def _specs(recipe: Recipe) -> list[tuple[str, ModelSpec]]:
    """(installed name, spec) in training order: the target first, then the draft."""
    return [(DEMO_MODELS[0], recipe.target), (DEMO_MODELS[1], recipe.draft)]


def _summary(manifest: dict[str, Any], report: EvalReport) -> str:
    lines = [f"demo models built in {manifest['wall_seconds']:.0f} s"]
    for name, stats in manifest["train"].items():
        lines.append(
            f"  {name}: {stats['parameters'] / 1e6:.2f}M params, loss {stats['first_loss']:.2f}"
            f" -> {stats['final_loss']:.3f} in {stats['seconds']:.0f} s"
        )
    lines.append(
        f"  draft/target greedy agreement {report.agreement:.1%}; held-out answers on topic "
        f"{report.topic_accuracy:.1%}, free of repetition {report.repetition_free:.1%}"
    )
    for sample in report.samples[:3]:
        lines.append(f"  Q: {sample['prompt']}\n  A: {sample['greedy']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the embedded demo models.")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--home", type=Path, default=None, help="default: $FIRSTLIGHT_HOME")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice); 1 is much faster on a busy machine",
    )
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    home = args.home or firstlight_home()
    if not args.force and is_built(home, args.seed):
        print(f"demo models up to date in {home / 'models'} (use --force to rebuild)")
        return
    build(home, args.seed, args.force)
    print(f"wrote {home / 'models' / 'demo'} and {home / 'models' / 'demo-draft'}")


if __name__ == "__main__":
    main()
