"""The ``simulate`` flags that depend on the model: a custom shape (``--layers`` and the flags beside it), and the
flags that act on one kind of layer only, refused on a model without that kind: they did nothing, without a word
(``--preset llama --ssm-interval 64`` ran the plain llama run). Their usage errors are ``flags.py``'s kind.
"""

from __future__ import annotations

import argparse
from typing import Final

from ..cli.layer_flags import SSM_LAYERS, WINDOW_LAYERS, refuse_without_layers
from ..cli.parsing import usage_error
from ..config import AttentionLayerConfig, SsmLayerConfig
from .options import SimulatorOptions
from .presets import DEFAULT_PRESET, ModelShape

MODEL_DEFAULTS: Final = ModelShape(1)
MODEL_FLAGS: Final = ("kv_heads", "head_dim", "window", "full_every", "attention_every")
# The flags acting on one kind of layer: the flag, the option it sets, the layers it acts on. A sweep of one of
# them (``--sweep ssm-interval=...``) is the same flag given once per point.
LAYER_FLAGS: Final = (
    ("--ssm-interval", "ssm_interval", SSM_LAYERS),
    ("--mamba-save-last-snapshot", "last_snapshot", SSM_LAYERS),
    ("--scratch", "scratch", WINDOW_LAYERS),
)
_DEFAULT_OPTIONS: Final = SimulatorOptions()


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The custom model's flags, in a group of their own."""
    group = parser.add_argument_group(
        "custom model", "A model shape instead of a preset: --layers, then the others (fp16 K and V pages).")
    add = group.add_argument
    add("--layers", type=int, default=None, help="layers of the model")
    add("--kv-heads", type=int, default=None, help=f"KV heads per layer (default {MODEL_DEFAULTS.num_kv_heads})")
    add("--head-dim", type=int, default=None, help=f"head dimension (default {MODEL_DEFAULTS.head_dim})")
    add("--window", type=int, default=None, help="sliding window of the attention layers in tokens, 0: full (default 0)")
    add("--full-every", type=int, default=None,
        help="with --window: every Nth attention layer is full attention (Gemma 3: 6), 0: none (default 0)")
    add("--attention-every", type=int, default=None,
        help="every Nth layer is attention, the others Mamba-2 SSM layers (Nemotron-H-like: 7); default 1")


def model_from_args(args: argparse.Namespace) -> ModelShape | None:
    """The custom shape the flags give, or None for a preset (a shape flag without ``--layers`` is a usage error)."""
    if args.layers is None:
        for name in MODEL_FLAGS:
            if getattr(args, name) is not None:
                usage_error(f"--{name.replace('_', '-')} {getattr(args, name)} needs --layers (a custom model shape)")
        return None
    if args.preset is not None:
        usage_error(f"--layers {args.layers} describes a custom model: drop --preset {args.preset}")
    given = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name) is not None}
    fields = {"kv_heads": "num_kv_heads"}
    return ModelShape(int(args.layers), **{fields.get(name, name): int(value) for name, value in given.items()})


def layer_kinds(options: SimulatorOptions) -> set[str]:
    """The kinds of ``LAYER_FLAGS`` layers the run's model has."""
    kinds: set[str] = set()
    for layer in options.layers():
        if isinstance(layer, SsmLayerConfig):
            kinds.add(SSM_LAYERS)
        elif isinstance(layer, AttentionLayerConfig) and layer.sliding_window_size is not None:
            kinds.add(WINDOW_LAYERS)
    return kinds


def _model_words(args: argparse.Namespace, options: SimulatorOptions) -> str:
    if options.model is not None:
        return "the " + options.model.describe().replace("custom (", "custom model (", 1)
    return f"the default preset ({DEFAULT_PRESET})" if args.preset is None else f"--preset {args.preset}"


def check_layer_flags(args: argparse.Namespace, options: SimulatorOptions) -> None:
    """A usage error naming every ``LAYER_FLAGS`` flag given (another value than its default) on a model without
    the layers it acts on, and the model."""
    given: list[tuple[str, str]] = []
    for flag, field, kind in LAYER_FLAGS:
        value = getattr(options, field)
        if value != getattr(_DEFAULT_OPTIONS, field):
            given.append((flag if isinstance(value, bool) else f"{flag} {value}", kind))
    refuse_without_layers(_model_words(args, options), given, layer_kinds(options))


def check_layer_sweep(args: argparse.Namespace, options: SimulatorOptions, text: str, field: str) -> None:
    """``--sweep PARAM=...`` of a ``LAYER_FLAGS`` option on a model without its layers: every point the same run."""
    for flag, flag_field, kind in LAYER_FLAGS:
        if flag_field == field and kind not in layer_kinds(options):
            usage_error(
                f"--sweep {text}: {_model_words(args, options)} has no {kind} for {flag} to act on (every point "
                "would be the same run)"
            )
