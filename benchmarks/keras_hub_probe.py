"""Session 22's probe: explain against XLA on keras-hub backbones that neither the corpus nor any test holds.

Qwen3-MoE and GPT-OSS (top-k routing), Falcon, BLOOM (ALiBi), GPT-NeoX (partial rotary), Phi-3, FNet (Fourier
mixing), OPT, DeBERTa-v3 (disentangled relative attention), RoFormer-v2, ESM-2 (rotary), ALBERT (shared layers),
ELECTRA, and three conv nets: DenseNet (concatenated blocks), Xception (separable convs) and VGG (max pools); tiny,
random init, a mean squared hidden state as the loss.  The layouts are generic, not hand-written per model (a user's first try):

* ``dp``: the batch over ``'data'``;
* ``fsdp``: the batch over ``'data'`` and every kernel's first axis over ``'data'`` (a conv kernel's last);
* ``tp``: every kernel's second axis over ``'model'`` (a conv kernel's last), the batch whole.

(A kernel is a parameter whose path ends in ``kernel``: embedding tables stay whole.)  ``fsdp_all`` and ``tp_all``
lay out every parameter of rank 2 or more so, embedding tables included (not the 2-row segment tables, nor a
depthwise kernel's 1-wide axis, which do not split).

Each case (loss and ``jax.grad``, Auto and Explicit meshes of (data=4, model=2)) is measured by the corpus's own
comparison (tests/external_corpus/compare.py: kinds and counts exact, bytes within 10%, peak within 25%) and
its status recorded: 'match', 'said-so' / 'incomplete' (the report says so), 'silent', 'error'.  Usage::

    python benchmarks/keras_hub_probe.py [--only SUBSTRING ...]

Writes benchmarks/results/keras_hub_probe.{json,md}; a run with --only merges into the JSON by case id.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import probe_runs  # noqa: E402
from external_corpus import Family  # noqa: E402
from external_corpus import families as corpus_families  # noqa: E402
from external_corpus._keras import pure_loss  # noqa: E402

V, D, F, S, B = 64, 32, 64, 8, 8
STRATEGIES = ("dp", "fsdp", "tp", "fsdp_all", "tp_all")
TOKENS = "b s -> b@data s"
# Kernels only (a path ending in ``kernel``): embedding tables and segment tables (2 rows) stay whole, a depthwise or
# pointwise kernel too.
_KERNEL = r"(/|\[')kernel'\]$"  # (a path as jax.tree_util.keystr writes it: "['block1_conv1/kernel']")
FSDP = ((_KERNEL, "a b c -> a@data b c"), (_KERNEL, "a b -> a@data b"), (_KERNEL, "a b c d -> a b c d@data"))
TP = ((_KERNEL, "a b c -> a b@model c"), (_KERNEL, "a b -> a b@model"), (_KERNEL, "a b c d -> a b c d@model"))
# Every parameter of rank 2 or more, embedding tables too (but the 2-row segment tables and the depthwise kernels'
# 1-wide axis, which do not split).
_ANY = r"^(?!.*(segment|depthwise))"
FSDP_ALL = ((_ANY, "a b c -> a@data b c"), (_ANY, "a b -> a@data b"), (_ANY, "a b c d -> a b c d@data"))
TP_ALL = ((_ANY, "a b c -> a b@model c"), (_ANY, "a b -> a b@model"), (_ANY, "a b c d -> a b c d@model"))


def _mean_square(out: Any, params: Any, target: Any) -> Any:
    if isinstance(out, dict):  # encoders: {'sequence_output', 'pooled_output'}
        out = out.get("sequence_output", next(iter(out.values())))
    return jnp.mean(jnp.square(out.astype(jnp.float32)))


def _family(name: str, model: Any, batch: Any, data: Any, whole: Any) -> Family:
    loss, params = pure_loss(model, _mean_square)
    rules = {"dp": (), "fsdp": FSDP, "tp": TP, "fsdp_all": FSDP_ALL, "tp_all": TP_ALL}
    batch_rules = {"dp": data, "fsdp": data, "tp": whole, "fsdp_all": data, "tp_all": whole}
    return Family(name, "keras-hub", "probe", loss, params, batch, rules, batch_rules)


def _text(name: str, make: Callable[[Any], Any], inputs: tuple[str, ...] = ("token_ids", "padding_mask")) -> Any:
    @cache
    def build() -> Family:
        import keras
        import keras_hub

        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        tokens = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
        keep = jnp.asarray(np.arange(S)[None, :] < rng.integers(S // 2, S + 1, (B, 1)), jnp.int32)
        feed = {"token_ids": tokens, "padding_mask": keep, "segment_ids": jnp.zeros((B, S), jnp.int32)}
        data = ({k: TOKENS for k in inputs}, TOKENS)
        whole = ({k: "b s -> b s" for k in inputs}, "b s -> b s")
        return _family(name, make(keras_hub.models), ({k: feed[k] for k in inputs}, tokens), data, whole)

    return build


def _image(name: str, make: Callable[[Any], Any]) -> Any:
    @cache
    def build() -> Family:
        import keras
        import keras_hub

        keras.utils.set_random_seed(0)
        images = jnp.asarray(np.random.default_rng(0).normal(size=(B, 16, 16, 3)), jnp.float32)
        data = ("b h w c -> b@data h w c", "b -> b@data")
        whole = ("b h w c -> b h w c", "b -> b")
        return _family(name, make(keras_hub.models), (images, jnp.zeros((B,), jnp.int32)), data, whole)

    return build


FAMILIES: dict[str, Callable[[], Family]] = {
    "p_qwen3moe": _text(
        "p_qwen3moe",
        lambda m: m.Qwen3MoeBackbone(
            vocabulary_size=V,
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=2,
            hidden_dim=D,
            intermediate_dim=F,
            moe_intermediate_dim=16,
            num_experts=4,
            head_dim=8,
            top_k=2,
            dtype="float32",
        ),
    ),
    "p_falcon": _text(
        "p_falcon",
        lambda m: m.FalconBackbone(
            vocabulary_size=V, num_layers=2, num_attention_heads=4, hidden_dim=D, intermediate_dim=F, dtype="float32"
        ),
    ),
    "p_bloom": _text(
        "p_bloom",
        lambda m: m.BloomBackbone(
            vocabulary_size=V, num_layers=2, num_heads=4, hidden_dim=D, intermediate_dim=F, dtype="float32"
        ),
    ),
    "p_neox": _text(
        "p_neox",
        lambda m: m.GPTNeoXBackbone(
            vocabulary_size=V,
            num_layers=2,
            num_heads=4,
            hidden_dim=D,
            intermediate_dim=F,
            rotary_percentage=0.5,
            max_sequence_length=S,
            dtype="float32",
        ),
    ),
    "p_phi3": _text(
        "p_phi3",
        lambda m: m.Phi3Backbone(
            vocabulary_size=V,
            num_layers=2,
            hidden_dim=D,
            intermediate_dim=F,
            num_query_heads=4,
            num_key_value_heads=2,
            max_sequence_length=S,
            dtype="float32",
        ),
    ),
    "p_fnet": _text(
        "p_fnet",
        lambda m: m.FNetBackbone(
            vocabulary_size=V, num_layers=2, hidden_dim=D, intermediate_dim=F, max_sequence_length=S, dtype="float32"
        ),
        inputs=("token_ids", "segment_ids"),
    ),
    "p_opt": _text(
        "p_opt",
        lambda m: m.OPTBackbone(
            vocabulary_size=V,
            num_layers=2,
            num_heads=4,
            hidden_dim=D,
            intermediate_dim=F,
            max_sequence_length=S,
            dtype="float32",
        ),
    ),
    "p_deberta": _text(
        "p_deberta",
        lambda m: m.DebertaV3Backbone(
            vocabulary_size=V,
            num_layers=2,
            num_heads=4,
            hidden_dim=D,
            intermediate_dim=F,
            max_sequence_length=S,
            bucket_size=4,
            dtype="float32",
        ),
    ),
    "p_gptoss": _text(
        "p_gptoss",
        lambda m: m.GptOssBackbone(
            vocabulary_size=V,
            num_layers=2,
            num_query_heads=4,
            hidden_dim=D,
            intermediate_dim=F,
            num_key_value_heads=2,
            num_experts=4,
            top_k=2,
            sliding_window=4,
            head_dim=8,
            dtype="float32",
        ),
    ),
    "p_roformer": _text(
        "p_roformer",
        lambda m: m.RoformerV2Backbone(
            vocabulary_size=V,
            num_layers=2,
            num_heads=4,
            hidden_dim=D,
            intermediate_dim=F,
            head_size=8,
            dtype="float32",
        ),
        inputs=("token_ids", "segment_ids", "padding_mask"),
    ),
    "p_esm2": _text(
        "p_esm2",
        lambda m: m.ESM2Backbone(
            vocabulary_size=V,
            num_layers=2,
            num_heads=4,
            hidden_dim=D,
            intermediate_dim=F,
            max_sequence_length=S,
            dtype="float32",
        ),
        inputs=("token_ids",),
    ),
    "p_albert": _text(
        "p_albert",
        lambda m: m.AlbertBackbone(
            vocabulary_size=V,
            num_layers=2,
            num_heads=4,
            embedding_dim=16,
            hidden_dim=D,
            intermediate_dim=F,
            max_sequence_length=S,
            dtype="float32",
        ),
        inputs=("token_ids", "segment_ids", "padding_mask"),
    ),
    "p_electra": _text(
        "p_electra",
        lambda m: m.ElectraBackbone(
            vocab_size=V,
            num_layers=2,
            num_heads=4,
            hidden_dim=D,
            embedding_dim=16,
            intermediate_dim=F,
            max_sequence_length=S,
            dtype="float32",
        ),
        inputs=("token_ids", "segment_ids", "padding_mask"),
    ),
    "p_densenet": _image(
        "p_densenet",
        lambda m: m.DenseNetBackbone(
            stackwise_num_repeats=[1, 1], image_shape=(16, 16, 3), compression_ratio=0.5, growth_rate=8
        ),
    ),
    "p_xception": _image(
        "p_xception",
        lambda m: m.XceptionBackbone(
            stackwise_conv_filters=[[8, 16], [16, 16]], stackwise_pooling=[False, True], image_shape=(16, 16, 3)
        ),
    ),
    "p_vgg": _image(
        "p_vgg",
        lambda m: m.VGGBackbone(stackwise_num_repeats=[1, 1], stackwise_num_filters=[8, 16], image_shape=(16, 16, 3)),
    ),
}


def cases() -> list[tuple[str, str, str, str]]:
    return [(f, s, m, k) for f in FAMILIES for s in STRATEGIES for m in ("fwd", "grad") for k in ("auto", "explicit")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/keras_hub_probe.json"))
    args = ap.parse_args()
    # The corpus's comparison finds a family by name in its registry: these join it for this process only.
    corpus_families.FAMILIES.update(FAMILIES)
    out = Path(args.out)
    results = probe_runs.run(cases(), out, args.only)
    table = probe_runs.summary(results, FAMILIES)
    print(table)
    out.with_suffix(".md").write_text(
        "# explain vs XLA on keras-hub backbones outside the corpus (benchmarks/keras_hub_probe.py)\n\n"
        "Generic layouts (dp, fsdp, tp as the script's docstring says), loss and gradient, Auto and Explicit "
        "(data=4, model=2) meshes; the corpus's comparison (kinds and counts exact, bytes within 10%, peak within "
        "25%).\n\n```\n"
        + table
        + "\n```\n\nThe cases that are not a match:\n\n"
        + "\n".join(
            f"- `{r['case']}` {r['status']}: {'; '.join(r.get('misses', ())) or r.get('error', '')}"
            for r in results.values()
            if r["status"] != "match"
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
