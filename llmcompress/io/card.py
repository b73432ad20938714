"""Model cards: every saved checkpoint gets a `README.md` (huggingface_hub's ModelCard) and its `recipe.yaml`.

The card's metadata says what the Hub needs to place the model in its base model's tree: `base_model` (a hub
id: the alias's upstream repo, the hub id it was loaded from, or the base model of a local source's own card),
`base_model_relation` (one of the Hub's four values: `quantized` for mixed-precision NAS results, `finetune`
for distilled students and for layer-collapsed models, which the Hub has no `pruned` relation for; they are
tagged `pruned`), the license carried over from the base model where known, and the method. The body holds
the measured metrics from the manifest and the exact command that made it. `recipe.yaml` is the full config
(the fields `--spec` takes, for the commands that have it).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

# upstream of the built-in aliases: (hub id, license)
ALIAS_UPSTREAM = {"smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def relation(method: str, manifest: dict) -> tuple[str, list[str]]:
    """(base_model_relation, extra tags) for an llmcompress method."""
    if method.startswith("nas"):
        bits = manifest.get("avg_bits") or (manifest.get("metrics") or {}).get("bits") or (manifest.get("config") or {}).get("target_bits")
        tags = ["pruned", "mixed-precision"]
        return ("quantized", tags) if bits is None or float(bits) < 16 else ("finetune", tags)
    if method.startswith("distill"):
        return "finetune", ["distillation", "pruned"]
    if method.startswith("collapse"):
        return "finetune", ["pruned", "layer-collapse"]
    return "finetune", []


def base_model_info(source: str) -> tuple[str | None, str | None]:
    """(hub id of the base model, its license) for a source spec, as far as can be told offline."""
    if source in ALIAS_UPSTREAM:
        return ALIAS_UPSTREAM[source]
    path = Path(source).expanduser()
    if path.exists():
        readme = path / "README.md" if path.is_dir() else path.with_name("README.md")
        if readme.is_file():
            try:
                from huggingface_hub import ModelCard

                data = ModelCard.load(readme).data
                base = data.get("base_model")
                return (base[0] if isinstance(base, list) and base else base), data.get("license")
            except Exception:  # noqa: BLE001 - a source without a readable card just has no known base
                return None, None
        return None, None
    if _HUB_ID.fullmatch(source):
        return source, _cached_hub_license(source)
    return None, None


def _cached_hub_license(repo_id: str) -> str | None:
    """The license in the hub model's README.md when it is in the local HF cache (no network)."""
    try:
        from huggingface_hub import ModelCard, try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "README.md")
        return ModelCard.load(cached).data.get("license") if isinstance(cached, str) else None
    except Exception:  # noqa: BLE001
        return None


def command_line(argv: list[str] | None = None) -> str | None:
    """The llmcompress command line this process runs, or None when it runs through the Python API."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return None
    prog = Path(argv[0])
    if prog.name == "llmcompress" or (prog.name == "__main__.py" and prog.parent.name == "llmcompress"):
        return shlex.join(["llmcompress", *argv[1:]])
    return None


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def model_card(manifest: dict, *, name: str, command: str | None):
    """A huggingface_hub ModelCard for a checkpoint described by its llmcompress manifest."""
    from huggingface_hub import ModelCard, ModelCardData

    source = (manifest.get("source_model") or {}).get("spec", "")
    method = str(manifest.get("method", "llmcompress"))
    base, license_ = base_model_info(source)
    rel, tags = relation(method, manifest)
    data = ModelCardData(
        base_model=base, license=license_, library_name="transformers", pipeline_tag="text-generation",
        tags=["llmcompress", method.split("/")[0].split("-")[0], *tags], model_name=name,
        **({"base_model_relation": rel} if base else {}),
    )
    metrics = manifest.get("metrics") or {}
    lines = [
        f"# {name}",
        "",
        f"Made with llmcompress {manifest.get('llmcompress_version', '')} by **{method}** from "
        f"`{source}`" + (f" (base model [{base}](https://huggingface.co/{base}), relation: {rel})." if base else "."),
        "",
        f"- layers: {manifest.get('layers')}, parameters: {manifest.get('parameters'):,}" if isinstance(manifest.get("parameters"), int)
        else f"- layers: {manifest.get('layers')}",
        f"- source weights sha256: `{(manifest.get('source_model') or {}).get('weights_sha256') or 'n/a'}`",
        f"- weights sha256: `{manifest.get('weights_sha256', 'n/a')}`",
        f"- license: {license_ or 'unknown (not carried over: the base model license could not be read)'}",
        "",
        "## Measured",
        "",
    ]
    if metrics:
        lines += ["| metric | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in metrics.items()]
    else:
        lines.append("No metrics were recorded in the manifest (`llmcompress eval` measures them).")
    lines += ["", "## How it was made", ""]
    lines.append(f"```bash\n{command}\n```" if command else "Through the llmcompress Python API (no command line).")
    if manifest.get("config"):
        lines += ["", "The full configuration is in `recipe.yaml`; `llmcompress.json` is the manifest (method, config, "
                  "metrics, environment)."]
    lines += ["", "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(PATH)", "tokenizer = AutoTokenizer.from_pretrained(PATH)", "```"]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def write_card(folder: Path, manifest: dict, *, name: str | None = None, command: str | None = None) -> None:
    """README.md (model card) and, when the manifest has a config, recipe.yaml, into `folder`."""
    import yaml

    from llmcompress.io.atomic import write_text

    folder = Path(folder)
    card = model_card(manifest, name=name or folder.name, command=command or command_line())
    write_text(folder / "README.md", str(card))
    if manifest.get("config"):
        config = json.loads(json.dumps(manifest["config"], default=str))
        write_text(folder / "recipe.yaml", f"# {manifest.get('method')} configuration (llmcompress)\n" + yaml.safe_dump(config, sort_keys=False))
