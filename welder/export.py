"""``welder export``: the models of the benchmark, rebuilt from code and exported to ONNX.

Neither the development machines nor the GPU machine can reach a model hub, so every
model is *constructed* (random weights, fixed seed) instead of downloaded.  Constructing
it again with the same name, batch, dtype, options and seed on the same library versions
gives the identical module, which is what lets the PyTorch peers of the benchmark time
exactly the module the ONNX file came from: ``export_onnx`` writes ``export.json`` beside
``model.onnx`` and ``rebuild`` turns it back into ``(module, inputs)``.  ``inputs.npz``
beside them holds the inputs of the export's check, so a later check of a build
(``artifacts/test_acc.py --inputs``) can run on them and reuse onnxruntime's outputs.

torch, transformers, timm and torchvision are optional (the ``models`` extra); this
module imports them only when a model needs them, so ``import welder.export`` always
works and a missing package is a :class:`WelderError` that says how to install it.

Every built module takes its inputs positionally, in the order of the ``inputs`` dict,
and returns a tensor or a tuple of tensors named by the model's ``outputs``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import platform
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from welder.errors import WelderError
from welder.files import replaced

if TYPE_CHECKING:
    import torch

Inputs = dict[str, "torch.Tensor"]
Built = tuple["torch.nn.Module", Inputs]

SEED = 0
DEFAULT_OPSET = 17
INSTALL_HINT = "pip install -e '.[models]'"
# Packages outside the models extra: torchaudio is built for one torch release, so it
# cannot be an extra that pip would resolve against whatever torch is installed.
PACKAGE_HINTS = {"torchaudio": "pip install torchaudio (the release built for the installed torch)"}
EXPORT_JSON = "export.json"
MODEL_ONNX = "model.onnx"
INPUTS_NPZ = "inputs.npz"  # the inputs the export's check ran on, by graph input name
NERF_POINTS = 1920 * 1080  # the original NeRF benchmark: one 1080p frame per batch element
NERF_LARGE_POINTS = 2 * 1024 * 1024  # "NeRF MLP 2M" in the earlier reference table
CALIBRATION_BATCH = 8  # images that set BatchNorm statistics


@dataclass(frozen=True)
class ModelSpec:
    """One model of the registry.  ``build(batch, options, seed)`` returns the fp32 module
    in eval mode and its fp32 example inputs drawn from ``seed``; ``options`` are the
    model's own knobs (a smaller config for tests, the NeRF point count, the image size)."""

    name: str
    summary: str
    packages: tuple[str, ...]
    outputs: tuple[str, ...]
    build: Callable[[int, Mapping[str, Any], int], Built]


@dataclass
class ExportInfo:
    """What ``export.json`` holds: enough to rebuild the exported module and its inputs,
    plus the versions that built it (a different version may initialise differently)."""

    model: str
    batch: int
    dtype: str
    seed: int
    opset: int
    options: dict[str, Any]
    inputs: dict[str, dict[str, Any]]
    outputs: list[str]
    versions: dict[str, str] = field(default_factory=dict)
    # The export's check against the torch module: each output's metric and limit, and the
    # onnxruntime provider that ran the graph (empty when the export was not checked).
    check: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ExportInfo:
        data = json.loads(text)
        missing = [k for k in ("model", "batch", "dtype", "seed") if k not in data]
        if missing:
            raise WelderError(f"{EXPORT_JSON} lacks {missing}; export the model again with welder export")
        return cls(
            model=data["model"],
            batch=int(data["batch"]),
            dtype=data["dtype"],
            seed=int(data["seed"]),
            opset=int(data.get("opset", DEFAULT_OPSET)),
            options=dict(data.get("options", {})),
            inputs=dict(data.get("inputs", {})),
            outputs=list(data.get("outputs", [])),
            versions=dict(data.get("versions", {})),
            check=dict(data.get("check", {})),
        )


# -- optional packages ---------------------------------------------------------------------


def require(package: str, model: str | None = None) -> Any:
    """Import ``package`` or raise a WelderError naming it and the extra that installs it.

    Any exception counts as missing, not just ImportError: a torchvision built for another
    torch fails with a RuntimeError while registering its operators, and the user's fix is
    the same (install a matching set of packages)."""
    try:
        return importlib.import_module(package)
    except Exception as e:
        who = f"model {model!r} needs" if model else "this needs"
        culprit = getattr(e, "name", None) or package
        detail = "" if isinstance(e, ModuleNotFoundError) else f" ({type(e).__name__}: {e})"
        roots = (culprit.split(".")[0], package.split(".")[0])
        hint = next((PACKAGE_HINTS[r] for r in roots if r in PACKAGE_HINTS), INSTALL_HINT)
        raise WelderError(
            f"{who} the package {culprit!r}, which cannot be imported{detail}; install it with {hint}"
        ) from None


def _torch() -> Any:
    return require("torch")


# -- inputs --------------------------------------------------------------------------------


def _generator(seed: int) -> torch.Generator:
    """A private generator for inputs, so drawing them never disturbs the global stream
    that initialises weights (and vice versa)."""
    gen = _torch().Generator()
    gen.manual_seed(seed + 1)
    return gen


def _normal(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return _torch().randn(shape, generator=_generator(seed))


def _integers(high: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    torch = _torch()
    return torch.randint(0, high, shape, generator=_generator(seed), dtype=torch.int64)


# -- the models ----------------------------------------------------------------------------


def _bert(batch: int, options: Mapping[str, Any], seed: int) -> Built:
    """bert-base (``BertConfig()`` defaults) over ``seq_len`` tokens.  The wrapper gives the
    module a positional signature and fixed outputs, which both the TorchScript exporter
    and the timing peers need; any other option overrides a BertConfig field."""
    torch = _torch()
    transformers = require("transformers", "bert")
    opts = dict(options)
    seq = int(opts.pop("seq_len", 128))
    config = transformers.BertConfig(**opts)
    model = transformers.BertModel(config).eval()

    class BertOutputs(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):  # type: ignore[no-untyped-def]
            out = self.bert(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                return_dict=True,
            )
            return out.last_hidden_state, out.pooler_output

    shape = (batch, seq)
    inputs = {
        "input_ids": _integers(config.vocab_size, shape, seed),
        # A full mask: unpadded sequences, the usual setting of latency benchmarks.
        "attention_mask": torch.ones(shape, dtype=torch.int64),
        "token_type_ids": _integers(config.type_vocab_size, shape, seed + 7),
    }
    return BertOutputs(model).eval(), inputs


def _calibrate_batchnorm(model: torch.nn.Module, shape: tuple[int, ...], seed: int) -> None:
    """Set BatchNorm running statistics from one seeded batch, as training would have.

    Freshly initialised statistics (mean 0, variance 1) do not normalise anything, so in
    eval mode activations drift with depth: MobileNetV2's logits come out near 1e-9 (zero
    in fp16) and ResNet-50's near 100.  Such outputs hide wrong results behind the
    relative-error floor and make fp16 timings run on zeros."""
    torch = _torch()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [bn.momentum for bn in norms]
    for bn in norms:
        bn.reset_running_stats()
        bn.momentum = None  # a plain average over the calibration batch
    model.train()
    with torch.no_grad():
        model(_normal(shape, seed + 11))
    for bn, momentum in zip(norms, momenta):
        bn.momentum = momentum
    model.eval()


def _timm(arch: str) -> Callable[[int, Mapping[str, Any], int], Built]:
    """A timm model by architecture name, ``pretrained=False``.  Options go to
    ``timm.create_model`` (``depth=2, embed_dim=64`` shrink a ViT for tests); the input
    size is the model's own (``img_size`` when given, else its pretrained config)."""

    def build(batch: int, options: Mapping[str, Any], seed: int) -> Built:
        timm = require("timm", arch)
        model = timm.create_model(arch, pretrained=False, **dict(options)).eval()
        size = options.get("img_size")
        if size is None:
            _, h, w = model.pretrained_cfg.get("input_size", (3, 224, 224))
        else:
            h, w = (size, size) if isinstance(size, int) else tuple(size)
        _calibrate_batchnorm(model, (CALIBRATION_BATCH, 3, int(h), int(w)), seed)
        return model, {"input": _normal((batch, 3, int(h), int(w)), seed)}

    return build


def _torchvision(arch: str, residual_scale: float = 1.0) -> Callable[[int, Mapping[str, Any], int], Built]:
    """A torchvision classifier with ``weights=None``; option ``img_size`` (default 224)
    sets the input resolution, any other option goes to the model's constructor.

    ``residual_scale`` multiplies the scale of the last BatchNorm of each ResNet block (the
    one before the residual add), before the statistics are set.  At 1 a randomly
    initialised ResNet-50 is chaotic: fp16 rounding grows by layer to a 5% error in the
    logits of torch's own fp16 module against the same weights in fp32, so no fp16 graph
    could match it.  Branches scaled by a quarter (between the default and torchvision's
    ``zero_init_residual``, which would leave the convolutions out of the result) keep
    that error at 1.5e-3, and torch's and onnxruntime's fp16 within 2.3e-3 of each other
    (at a half: 9e-3 and 1.2e-2, too near fp16's limit of 2e-2)."""

    def build(batch: int, options: Mapping[str, Any], seed: int) -> Built:
        models = require("torchvision.models", arch)
        opts = dict(options)
        size = int(opts.pop("img_size", 224))
        model = getattr(models, arch)(weights=None, **opts).eval()
        if residual_scale != 1.0:
            torch = _torch()
            with torch.no_grad():
                for block in model.modules():
                    last = getattr(block, "bn3", None) or getattr(block, "bn2", None)
                    if last is not None and hasattr(block, "conv1"):
                        last.weight.mul_(residual_scale)
        _calibrate_batchnorm(model, (CALIBRATION_BATCH, 3, size, size), seed)
        return model, {"input": _normal((batch, 3, size, size), seed)}

    return build


def _nerf(defaults: Mapping[str, Any]) -> Callable[[int, Mapping[str, Any], int], Built]:
    """A NeRF MLP: ``depth`` ReLU layers of ``width`` over a positionally encoded point
    (``in_dim`` features), the input concatenated again before layer ``skip`` (none when
    ``skip`` is null), and a linear head of ``outputs`` values.  ``batch`` multiplies
    ``points``.  Both registry entries are this builder: ``nerf`` with the original's small
    MLP and ``nerf_large`` with the 8x256 one that the earlier tables measured."""

    def build(batch: int, options: Mapping[str, Any], seed: int) -> Built:
        torch = _torch()
        opts = {**defaults, **options}
        in_dim, width, depth = int(opts["in_dim"]), int(opts["width"]), int(opts["depth"])
        skip = None if opts.get("skip") is None else int(opts["skip"])
        outputs, points = int(opts["outputs"]), int(opts["points"])

        class NeRFMLP(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                sizes = [in_dim] + [width + (in_dim if i == skip else 0) for i in range(1, depth)]
                self.layers = torch.nn.ModuleList(torch.nn.Linear(n, width) for n in sizes)
                self.head = torch.nn.Linear(width, outputs)

            def forward(self, points):  # type: ignore[no-untyped-def]
                h = points
                for i, layer in enumerate(self.layers):
                    if i == skip:
                        h = torch.cat([points, h], dim=-1)
                    h = torch.relu(layer(h))
                return self.head(h)

        return NeRFMLP().eval(), {"points": _normal((batch * points, in_dim), seed)}

    return build


NERF = {"in_dim": 60, "width": 64, "depth": 7, "skip": None, "outputs": 3, "points": NERF_POINTS}
NERF_LARGE = {"in_dim": 60, "width": 256, "depth": 8, "skip": 4, "outputs": 4, "points": NERF_LARGE_POINTS}


# -- image restoration models, written from their papers ------------------------------------
#
# BSRN, NAFNet and Restormer have no package to build them from, so they are compact
# modules of our own following the papers' descriptions at their default sizes.  They
# keep each paper's operators (blueprint separable convolutions and attention maps,
# simple gates, transposed channel attention), which is what a compiler benchmark needs;
# training-only parts (dropout, drop-path) are left out.


def _image(batch: int, options: Mapping[str, Any], seed: int) -> Inputs:
    size = options.get("img_size", 256)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return {"input": _normal((batch, 3, int(h), int(w)), seed)}


def _restoration_layers() -> Any:
    """The building blocks the three restoration models share, defined once torch is
    imported (this module must import without it)."""
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional

    class ChannelNorm(nn.Module):
        """LayerNorm over the channels of every pixel (NAFNet's and Restormer's norm)."""

        def __init__(self, channels: int, bias: bool = True) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(channels, elementwise_affine=True, bias=bias)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    class BSConv(nn.Module):
        """Blueprint separable convolution (BSConv-U): a pointwise convolution mixing the
        channels, then a depthwise k x k convolution filtering each one."""

        def __init__(self, cin: int, cout: int, k: int = 3) -> None:
            super().__init__()
            self.pw = nn.Conv2d(cin, cout, 1, bias=False)
            self.dw = nn.Conv2d(cout, cout, k, padding=k // 2, groups=cout)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.dw(self.pw(x))

    return nn, F, ChannelNorm, BSConv


def _bsrn(batch: int, options: Mapping[str, Any], seed: int) -> Built:
    """BSRN (Li et al., "Blueprint Separable Residual Network for Efficient Image
    Super-Resolution", 2022) at its defaults: 64 channels, 8 ESDBs, x4 upscaling of a
    256x256 image.  An ESDB distils features in three stages (a 1x1 convolution keeps half
    the channels while a blueprint shallow residual block refines the rest), fuses the
    distilled features and reweights them with enhanced spatial attention (a strided
    convolution, max pooling, bilinear upsampling) and contrast-aware channel attention
    (mean plus standard deviation per channel).  Options: ``channels``, ``blocks``,
    ``upscale``, ``img_size``."""
    torch = _torch()
    nn, F, _, BSConv = _restoration_layers()
    c = int(options.get("channels", 64))
    n_blocks = int(options.get("blocks", 8))
    scale = int(options.get("upscale", 4))

    class ESA(nn.Module):
        def __init__(self, ch: int) -> None:
            super().__init__()
            f = ch // 4
            self.reduce = nn.Conv2d(ch, f, 1)
            self.down = nn.Conv2d(f, f, 3, stride=2)
            self.body = BSConv(f, f)
            self.skip = nn.Conv2d(f, f, 1)
            self.expand = nn.Conv2d(f, ch, 1)

        def forward(self, x):  # type: ignore[no-untyped-def]
            r = self.reduce(x)
            y = F.max_pool2d(self.down(r), kernel_size=7, stride=3)
            y = F.interpolate(F.gelu(self.body(y)), size=x.shape[2:], mode="bilinear", align_corners=False)
            return x * torch.sigmoid(self.expand(y + self.skip(r)))

    class CCA(nn.Module):
        def __init__(self, ch: int) -> None:
            super().__init__()
            self.squeeze = nn.Conv2d(ch, max(ch // 16, 1), 1)
            self.excite = nn.Conv2d(max(ch // 16, 1), ch, 1)

        def forward(self, x):  # type: ignore[no-untyped-def]
            mean = x.mean(dim=(2, 3), keepdim=True)
            std = (x - mean).pow(2).mean(dim=(2, 3), keepdim=True).sqrt()
            return x * torch.sigmoid(self.excite(F.relu(self.squeeze(std + mean))))

    class ESDB(nn.Module):
        def __init__(self, ch: int) -> None:
            super().__init__()
            half = ch // 2
            self.distil = nn.ModuleList(nn.Conv2d(ch, half, 1) for _ in range(3))
            self.refine = nn.ModuleList(BSConv(ch, ch) for _ in range(3))
            self.last = BSConv(ch, half)
            self.fuse = nn.Conv2d(4 * half, ch, 1)
            self.esa, self.cca = ESA(ch), CCA(ch)

        def forward(self, x):  # type: ignore[no-untyped-def]
            kept, r = [], x
            for distil, refine in zip(self.distil, self.refine):
                kept.append(distil(r))
                r = F.gelu(refine(r) + r)  # blueprint shallow residual block
            kept.append(F.gelu(self.last(r)))
            return self.cca(self.esa(self.fuse(torch.cat(kept, dim=1)))) + x

    class BSRN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = BSConv(3, c)
            self.blocks = nn.ModuleList(ESDB(c) for _ in range(n_blocks))
            self.merge = nn.Conv2d(n_blocks * c, c, 1)
            self.smooth = BSConv(c, c)
            self.tail = nn.Conv2d(c, 3 * scale * scale, 3, padding=1)
            self.shuffle = nn.PixelShuffle(scale)

        def forward(self, x):  # type: ignore[no-untyped-def]
            shallow = h = self.head(x)
            outs = []
            for block in self.blocks:
                h = block(h)
                outs.append(h)
            h = self.smooth(F.gelu(self.merge(torch.cat(outs, dim=1)))) + shallow
            return self.shuffle(self.tail(h))

    return BSRN().eval(), _image(batch, options, seed)


def _nafnet(batch: int, options: Mapping[str, Any], seed: int) -> Built:
    """NAFNet (Chen et al., "Simple Baselines for Image Restoration", 2022): a four-level
    U-Net of activation-free blocks -- LayerNorm, 1x1 and depthwise 3x3 convolutions, a
    simple gate (the two channel halves multiplied) and simplified channel attention --
    here at width 16 with one block per level and one in the middle, on a 3x256x256 image.
    The residual scales start at 1 rather than the paper's 0 (a trained model's are
    non-zero; at 0 every block would be the identity).  Options: ``width``,
    ``enc_blocks``, ``middle_blocks``, ``dec_blocks``, ``img_size``."""
    torch = _torch()
    nn, F, ChannelNorm, _ = _restoration_layers()
    width = int(options.get("width", 16))
    enc = [int(n) for n in options.get("enc_blocks", [1, 1, 1, 1])]
    middle = int(options.get("middle_blocks", 1))
    dec = [int(n) for n in options.get("dec_blocks", [1, 1, 1, 1])]

    class NAFBlock(nn.Module):
        def __init__(self, ch: int) -> None:
            super().__init__()
            self.norm1, self.norm2 = ChannelNorm(ch), ChannelNorm(ch)
            self.expand = nn.Conv2d(ch, 2 * ch, 1)
            self.dw = nn.Conv2d(2 * ch, 2 * ch, 3, padding=1, groups=2 * ch)
            self.attention = nn.Conv2d(ch, ch, 1)
            self.project = nn.Conv2d(ch, ch, 1)
            self.ffn_in = nn.Conv2d(ch, 2 * ch, 1)
            self.ffn_out = nn.Conv2d(ch, ch, 1)
            self.beta = nn.Parameter(torch.ones(1, ch, 1, 1))
            self.gamma = nn.Parameter(torch.ones(1, ch, 1, 1))

        @staticmethod
        def gate(x):  # type: ignore[no-untyped-def]
            a, b = x.chunk(2, dim=1)
            return a * b

        def forward(self, x):  # type: ignore[no-untyped-def]
            y = self.gate(self.dw(self.expand(self.norm1(x))))
            y = y * self.attention(F.adaptive_avg_pool2d(y, 1))
            x = x + self.project(y) * self.beta
            y = self.ffn_out(self.gate(self.ffn_in(self.norm2(x))))
            return x + y * self.gamma

    def stage(ch: int, n: int) -> Any:
        return nn.Sequential(*(NAFBlock(ch) for _ in range(n)))

    class NAFNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.intro = nn.Conv2d(3, width, 3, padding=1)
            self.ending = nn.Conv2d(width, 3, 3, padding=1)
            self.encoders, self.downs = nn.ModuleList(), nn.ModuleList()
            ch = width
            for n in enc:
                self.encoders.append(stage(ch, n))
                self.downs.append(nn.Conv2d(ch, 2 * ch, 2, stride=2))
                ch *= 2
            self.middle = stage(ch, middle)
            self.ups, self.decoders = nn.ModuleList(), nn.ModuleList()
            for n in dec:
                self.ups.append(nn.Sequential(nn.Conv2d(ch, 2 * ch, 1, bias=False), nn.PixelShuffle(2)))
                ch //= 2
                self.decoders.append(stage(ch, n))

        def forward(self, inp):  # type: ignore[no-untyped-def]
            x = self.intro(inp)
            skips = []
            for encoder, down in zip(self.encoders, self.downs):
                x = encoder(x)
                skips.append(x)
                x = down(x)
            x = self.middle(x)
            for decoder, up, skip in zip(self.decoders, self.ups, reversed(skips)):
                x = decoder(up(x) + skip)
            return self.ending(x) + inp

    return NAFNet().eval(), _image(batch, options, seed)


def _restormer(batch: int, options: Mapping[str, Any], seed: int) -> Built:
    """Restormer (Zamir et al., "Restormer: Efficient Transformer for High-Resolution
    Image Restoration", 2022) at its defaults: width 48, [4, 6, 6, 8] transformer blocks
    over four levels with [1, 2, 4, 8] heads, 4 refinement blocks, a gated-GELU
    feed-forward network expanded 2.66 times, no biases, on a 3x256x256 image.  Its
    attention is across channels (MDTA: 1x1 and depthwise 3x3 convolutions make q, k and
    v; q and k are L2-normalised over the pixels and their channel-by-channel product is
    scaled by a learnt temperature per head), so its cost grows linearly with the image.
    Options: ``dim``, ``blocks``, ``heads``, ``refinement``, ``ffn_factor``, ``img_size``."""
    torch = _torch()
    nn, F, ChannelNorm, _ = _restoration_layers()
    dim = int(options.get("dim", 48))
    blocks = [int(n) for n in options.get("blocks", [4, 6, 6, 8])]
    heads = [int(n) for n in options.get("heads", [1, 2, 4, 8])]
    refinement = int(options.get("refinement", 4))
    factor = float(options.get("ffn_factor", 2.66))

    class MDTA(nn.Module):
        def __init__(self, ch: int, n_heads: int) -> None:
            super().__init__()
            self.heads = n_heads
            self.temperature = nn.Parameter(torch.ones(n_heads, 1, 1))
            self.qkv = nn.Conv2d(ch, 3 * ch, 1, bias=False)
            self.dw = nn.Conv2d(3 * ch, 3 * ch, 3, padding=1, groups=3 * ch, bias=False)
            self.project = nn.Conv2d(ch, ch, 1, bias=False)

        def forward(self, x):  # type: ignore[no-untyped-def]
            b, c, h, w = x.shape
            split = (b, self.heads, c // self.heads, h * w)
            q, k, v = (t.reshape(split) for t in self.dw(self.qkv(x)).chunk(3, dim=1))
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            attn = torch.softmax(q @ k.transpose(-2, -1) * self.temperature, dim=-1)
            return self.project((attn @ v).reshape(b, c, h, w))

    class GDFN(nn.Module):
        def __init__(self, ch: int) -> None:
            super().__init__()
            hidden = int(ch * factor)
            self.expand = nn.Conv2d(ch, 2 * hidden, 1, bias=False)
            self.dw = nn.Conv2d(2 * hidden, 2 * hidden, 3, padding=1, groups=2 * hidden, bias=False)
            self.project = nn.Conv2d(hidden, ch, 1, bias=False)

        def forward(self, x):  # type: ignore[no-untyped-def]
            a, g = self.dw(self.expand(x)).chunk(2, dim=1)
            return self.project(F.gelu(a) * g)

    class Block(nn.Module):
        def __init__(self, ch: int, n_heads: int) -> None:
            super().__init__()
            self.norm1, self.attn = ChannelNorm(ch), MDTA(ch, n_heads)
            self.norm2, self.ffn = ChannelNorm(ch), GDFN(ch)

        def forward(self, x):  # type: ignore[no-untyped-def]
            x = x + self.attn(self.norm1(x))
            return x + self.ffn(self.norm2(x))

    def stage(ch: int, n: int, n_heads: int) -> Any:
        return nn.Sequential(*(Block(ch, n_heads) for _ in range(n)))

    def down(ch: int) -> Any:  # halves the size, doubles the channels
        return nn.Sequential(nn.Conv2d(ch, ch // 2, 3, padding=1, bias=False), nn.PixelUnshuffle(2))

    def up(ch: int) -> Any:  # doubles the size, halves the channels
        return nn.Sequential(nn.Conv2d(ch, 2 * ch, 3, padding=1, bias=False), nn.PixelShuffle(2))

    class Restormer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            chs = [dim, 2 * dim, 4 * dim, 8 * dim]
            self.embed = nn.Conv2d(3, dim, 3, padding=1, bias=False)
            self.encoders = nn.ModuleList(stage(chs[i], blocks[i], heads[i]) for i in range(3))
            self.downs = nn.ModuleList(down(chs[i]) for i in range(3))
            self.latent = stage(chs[3], blocks[3], heads[3])
            self.ups = nn.ModuleList(up(chs[i + 1]) for i in range(3))
            # Levels 2 and 3 reduce the concatenated skip back to their width; level 1
            # keeps both halves (2 * dim channels), as do the refinement blocks.
            self.reduce = nn.ModuleList(nn.Conv2d(2 * chs[i], chs[i], 1, bias=False) for i in (1, 2))
            self.decoders = nn.ModuleList(
                [stage(chs[1], blocks[0], heads[0])] + [stage(chs[i], blocks[i], heads[i]) for i in (1, 2)]
            )
            self.refine = stage(chs[1], refinement, heads[0])
            self.output = nn.Conv2d(chs[1], 3, 3, padding=1, bias=False)

        def forward(self, inp):  # type: ignore[no-untyped-def]
            x = self.embed(inp)
            skips = []
            for encoder, d in zip(self.encoders, self.downs):
                x = encoder(x)
                skips.append(x)
                x = d(x)
            x = self.latent(x)
            for level in (2, 1, 0):
                x = torch.cat([self.ups[level](x), skips[level]], dim=1)
                if level > 0:
                    x = self.reduce[level - 1](x)
                x = self.decoders[level](x)
            return self.output(self.refine(x)) + inp

    return Restormer().eval(), _image(batch, options, seed)


def _conformer(batch: int, options: Mapping[str, Any], seed: int) -> Built:
    """torchaudio's Conformer encoder as the Welder paper runs it: input dim 512, 8 heads,
    FFN 512, 12 layers, depthwise kernel 31, over ``frames`` (512) frames; every sequence
    is full length (the lengths input holds ``frames``).  Any other option overrides a
    ``torchaudio.models.Conformer`` argument."""
    torch = _torch()
    require("torchaudio", "conformer")  # the message names the package, not its module
    torchaudio_models = require("torchaudio.models", "conformer")
    opts = dict(options)
    frames = int(opts.pop("frames", 512))
    args = {
        "input_dim": 512,
        "num_heads": 8,
        "ffn_dim": 512,
        "num_layers": 12,
        "depthwise_conv_kernel_size": 31,
        **opts,
    }
    model = torchaudio_models.Conformer(**args).eval()
    inputs = {
        "input": _normal((batch, frames, int(args["input_dim"])), seed),
        "lengths": torch.full((batch,), frames, dtype=torch.int64),
    }
    return model, inputs


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "bert",
            "transformers BertModel, BertConfig() defaults (bert-base), seq 128",
            ("torch", "transformers"),
            ("last_hidden_state", "pooler_output"),
            _bert,
        ),
        ModelSpec(
            "vit_small_p32",
            "timm vit_small_patch32_224",
            ("torch", "timm", "torchvision"),
            ("output",),
            _timm("vit_small_patch32_224"),
        ),
        ModelSpec(
            "swin_tiny",
            "timm swin_tiny_patch4_window7_224",
            ("torch", "timm", "torchvision"),
            ("output",),
            _timm("swin_tiny_patch4_window7_224"),
        ),
        ModelSpec(
            "mobilenet_v2",
            "torchvision mobilenet_v2, 224x224",
            ("torch", "torchvision"),
            ("output",),
            _torchvision("mobilenet_v2"),
        ),
        ModelSpec(
            "mobilevit_s",
            "timm mobilevit_s, 256x256",
            ("torch", "timm", "torchvision"),
            ("output",),
            _timm("mobilevit_s"),
        ),
        ModelSpec(
            "bsrn",
            "BSRN (own module from the paper): 64 channels, 8 ESDBs, x4 upscaling, 3x256x256",
            ("torch",),
            ("output",),
            _bsrn,
        ),
        ModelSpec(
            "nafnet",
            "NAFNet (own module from the paper): width 16, one block per level, 3x256x256",
            ("torch",),
            ("output",),
            _nafnet,
        ),
        ModelSpec(
            "restormer",
            "Restormer (own module from the paper): dim 48, blocks [4,6,6,8], 3x256x256",
            ("torch",),
            ("output",),
            _restormer,
        ),
        ModelSpec(
            "conformer",
            "torchaudio Conformer: dim 512, 8 heads, FFN 512, 12 layers, kernel 31, 512 frames",
            ("torch", "torchaudio"),
            ("output", "output_lengths"),
            _conformer,
        ),
        ModelSpec(
            "nerf",
            "NeRF MLP (the original's): 7 ReLU layers of 64, 3 outputs, 1920x1080 points",
            ("torch",),
            ("output",),
            _nerf(NERF),
        ),
        ModelSpec(
            "nerf_large",
            "NeRF MLP: 8 layers of 256 with a skip, 60-dim input, 4 outputs, 2M points",
            ("torch",),
            ("output",),
            _nerf(NERF_LARGE),
        ),
        ModelSpec(
            "resnet50",
            "torchvision resnet50, 224x224, residual branches' last BatchNorm scaled by 1/4",
            ("torch", "torchvision"),
            ("output",),
            _torchvision("resnet50", residual_scale=0.25),
        ),
    )
}


#: The paper's ten models (Welder, OSDI'23), in the order of its figures; the registry
#: holds a few more (nerf_large, resnet50).
PAPER_MODELS = (
    "bert",
    "vit_small_p32",
    "swin_tiny",
    "mobilenet_v2",
    "mobilevit_s",
    "bsrn",
    "nafnet",
    "restormer",
    "conformer",
    "nerf",
)


def get_spec(name: str) -> ModelSpec:
    spec = MODELS.get(name)
    if spec is None:
        raise WelderError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return spec


# -- building ------------------------------------------------------------------------------


def build_model(
    name: str,
    batch: int = 1,
    fp16: bool = False,
    *,
    bf16: bool = False,
    options: Mapping[str, Any] | None = None,
    seed: int = SEED,
) -> Built:
    """``(module, inputs)`` for a registry model: eval mode, weights from ``seed``, inputs
    from a generator derived from the same seed.  With ``fp16`` the module is ``.half()``
    and the float inputs are half (``bf16``: bfloat16 likewise); integer inputs (token ids)
    stay int64.  Both stay on the CPU: the caller moves them, so the weights never depend on
    the device."""
    spec = get_spec(name)
    if batch < 1:
        raise WelderError(f"batch must be at least 1, got {batch}")
    if fp16 and bf16:
        raise WelderError("choose one of fp16 and bf16")
    torch = require_packages(name)
    # fork_rng: seeding must not change the caller's random stream.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(seed)
        warnings.simplefilter("ignore")
        module, inputs = spec.build(batch, dict(options or {}), seed)
    if fp16 or bf16:
        dtype = torch.float16 if fp16 else torch.bfloat16
        module = module.to(dtype)
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    return module.eval(), inputs


def require_packages(name: str) -> Any:
    """Check every package model ``name`` needs (the error names the model); returns torch."""
    for package in get_spec(name).packages:
        require(package, name)
    return _torch()


def output_names(name: str) -> list[str]:
    return list(get_spec(name).outputs)


def package_versions(name: str) -> dict[str, str]:
    """Versions of the packages the model is built from, recorded in export.json so a
    rebuild on another machine can say when it may not be the same module."""
    versions = {"python": platform.python_version()}
    for package in get_spec(name).packages:
        try:
            versions[package] = str(importlib.import_module(package).__version__)
        except Exception:
            versions[package] = "unavailable"
    return versions


# -- exporting -----------------------------------------------------------------------------


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _pick_device(device: str | None) -> str:
    """The GPU when there is one (the device the peers time the module on), else the CPU.
    Tracing runs the module once, and at batch 64 the CPU takes minutes for it.  An fp16
    export must come out a half graph either way, which :func:`check_half_graph` verifies;
    TF32 stays off while tracing, as in the check (:func:`_exact_fp32`)."""
    torch = _torch()
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def _exact_fp32() -> Iterator[None]:
    """TF32 off for torch's matrix products and convolutions, restored after: an fp32
    module then computes in fp32, as the exported graph does under onnxruntime."""
    torch = _torch()
    cuda = torch.backends.cuda.matmul
    saved = (cuda.allow_tf32, torch.backends.cudnn.allow_tf32)
    cuda.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        cuda.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def check_half_graph(path: Path, dtype: str = "float16") -> None:
    """Raise a WelderError unless the fp16 model at ``path`` keeps its weights in half
    (a float32 scalar or two, such as mask fill values, may stay) and onnxruntime loads it.
    A half module whose trace promoted some of its ops to float32 exports a graph of mixed
    types: not the model that was asked for, and one onnxruntime refuses.  A bf16 model
    (``dtype`` bfloat16) passes onnx's checker instead: onnxruntime's CPU provider has no
    bf16 arithmetic, so it refuses every such model."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    label = "fp16" if dtype == "float16" else "bf16"
    singles = [
        f"{t.name} {list(t.dims)}"
        for t in model.graph.initializer
        if t.data_type == onnx.TensorProto.FLOAT and math.prod(t.dims) > 1
    ]
    kind = "half" if dtype == "float16" else "bf16"
    problem = f"float32 weights beside {kind} ones ({', '.join(singles[:4])})" if singles else ""
    if not problem and dtype == "bfloat16":
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as e:
            problem = f"a graph onnx's checker refuses ({str(e).strip().splitlines()[0][:300]})"
    elif not problem:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        try:
            ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:
            problem = f"a graph onnxruntime refuses ({str(e).strip().splitlines()[0][:300]})"
    if problem:
        raise WelderError(f"the {label} export traced to {problem}; {path} was not kept")


def check_outputs(
    path: Path,
    module: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor],
    feeds: Mapping[str, Any],
    names: list[str],
    reference_cache: Path | None = None,
) -> dict[str, Any]:
    """Run the module on ``inputs`` and the exported graph with onnxruntime on ``feeds``
    (the same values, those the graph takes: :func:`graph_feeds`); compare every output with
    the module's (``max(|a-b|/max(|b|,1))`` against ``welder.check.threshold_for`` of the
    output's dtype: 1e-4 for fp32, 2e-2 for fp16, exact for integers); raise a WelderError
    naming the outputs that miss, else return the metrics for export.json.

    Where torch sees a GPU both sides run there -- the module moved to it for the check
    (and back), the graph under onnxruntime's CUDA provider when it has one -- since on
    the CPU a large batch takes minutes each way.  TF32 is off on both sides, so an fp32
    module computes in fp32 as the graph does.  Otherwise, or when the CUDA provider
    cannot take the graph, onnxruntime's CPU provider runs it (bf16 graphs converted to
    fp32, as ``welder.check.onnxruntime_outputs`` does), its outputs kept in
    ``reference_cache`` for test_acc (:func:`welder.check.cached_onnxruntime_outputs`)."""
    from welder.check import cached_onnxruntime_outputs, error_metric, threshold_for

    torch = _torch()
    home = next((v.device for v in inputs.values()), torch.device("cpu"))
    device = torch.device("cuda") if torch.cuda.is_available() else home
    bf16 = any(v.dtype == torch.bfloat16 for v in inputs.values())
    try:
        with torch.no_grad(), warnings.catch_warnings(), _exact_fp32():
            warnings.simplefilter("ignore")
            out = module.to(device)(*(v.to(device) for v in inputs.values()))
    finally:
        module.to(home)
    tensors = tuple(t.detach().cpu() for t in (out if isinstance(out, tuple) else (out,)))
    del out
    provider = "CPUExecutionProvider"
    reference = None
    if device.type == "cuda" and not bf16:
        reference, provider = _cuda_outputs(path, feeds)
    if reference is None:
        provider = "CPUExecutionProvider"
        reference = cached_onnxruntime_outputs(path, feeds, names, reference_cache)
    report: dict[str, Any] = {"reference": f"onnxruntime {provider}", "outputs": {}}
    misses = []
    for name, got in zip(names, tensors):
        ref = reference[name]
        kind = _dtype_name(got)
        got = got.float().numpy() if got.is_floating_point() else got.numpy()
        want = ref.astype(np.float32) if got.dtype == np.float32 else ref
        metric, limit = error_metric(got, want), threshold_for(kind)
        report["outputs"][name] = {"metric": metric, "limit": limit}
        if not metric <= limit:
            misses.append(f"{name} {metric:.2e} > {limit:.0e}")
    if misses:
        raise WelderError(
            f"the exported graph does not compute the module under onnxruntime ({', '.join(misses)}); "
            f"{path} was not kept"
        )
    return report


def graph_feeds(path: Path, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The inputs the graph at ``path`` takes, as numpy arrays (the exporter drops the
    module's inputs that no output reads, and test_acc feeds the graph's alone)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    taken = {i.name for i in graph.input} - {t.name for t in graph.initializer}
    return {k: v for k, v in to_numpy(inputs).items() if k in taken}


def _cuda_outputs(path: Path, feeds: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The graph's outputs under onnxruntime's CUDA provider with TF32 off, or None where
    this onnxruntime has no such provider or it cannot take the graph."""
    import onnxruntime as ort

    name = "CUDAExecutionProvider"
    if name not in ort.get_available_providers():
        return None, name
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        sess = ort.InferenceSession(
            str(path), opts, providers=[(name, {"use_tf32": "0"}), "CPUExecutionProvider"]
        )
        if sess.get_providers()[0] != name:
            return None, name
        outputs = [o.name for o in sess.get_outputs()]
        wanted = {i.name for i in sess.get_inputs()}  # the exporter drops unread inputs
        values = sess.run(outputs, {k: v for k, v in feeds.items() if k in wanted})
        return dict(zip(outputs, values)), name
    except Exception:
        return None, name


# -- half precision attention ---------------------------------------------------------------

SDPA_OP = "aten::scaled_dot_product_attention"
# TorchScript's names of the float types and their ONNX TensorProto codes.
_ONNX_FLOAT = {"Half": 10, "Float": 1, "Double": 11, "BFloat16": 16}


def _sdpa_symbolic() -> Callable[..., Any]:
    """``aten::scaled_dot_product_attention`` in ONNX with every constant in the query's
    dtype.

    The TorchScript exporter's own version turns a boolean mask into a float32 ``0/-inf``
    mask whatever the query's dtype.  Adding it to half attention scores makes the export's
    type promotion cast the scores -- and then, one op after another, the attention output,
    the following Linear weights (folded into float32 ``onnx::MatMul_*`` initializers) and
    the residual sums -- to float32, until a LayerNormalization meets a float32 input with
    its half scale and bias, a graph onnxruntime refuses to load.  Here the mask, the scale
    and the guard against fully masked rows (softmax of all ``-inf`` is NaN in ONNX, 0 in
    torch) are built in the query's dtype, so a half module exports as a half graph."""
    torch = _torch()
    from torch.onnx import symbolic_helper

    @symbolic_helper.parse_args("v", "v", "v", "v", "f", "b", "v", "b")
    def sdpa(g, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):  # type: ignore[no-untyped-def]
        kind = query.type().scalarType()
        if kind not in _ONNX_FLOAT:
            raise WelderError(f"scaled_dot_product_attention on {kind} queries cannot be exported")
        dtype = getattr(torch, {"Half": "float16", "Float": "float32"}.get(kind, kind.lower()))
        if enable_gqa:
            raise WelderError("scaled_dot_product_attention with enable_gqa cannot be exported")

        def const(x: Any) -> Any:
            return g.op("Constant", value_t=torch.tensor(x, dtype=dtype))

        q_sizes, k_sizes = query.type().sizes(), key.type().sizes()
        if scale.node().mustBeNone():
            root = const(1.0 / math.sqrt(math.sqrt(q_sizes[-1])))  # sqrt(1/sqrt(E)), on q and k
        else:
            root = g.op("Sqrt", g.op("Cast", scale, to_i=_ONNX_FLOAT[kind]))
        perm = list(range(len(k_sizes)))
        perm[-2], perm[-1] = perm[-1], perm[-2]
        # Both sides scaled by sqrt(scale) before the product, as torch's math kernel does:
        # half scores then stay in range.
        scores = g.op(
            "MatMul", g.op("Mul", query, root), g.op("Mul", g.op("Transpose", key, perm_i=perm), root)
        )
        mask = None
        if is_causal:
            keep = torch.ones(q_sizes[-2], k_sizes[-2], dtype=torch.bool).tril()
            mask = g.op("Constant", value_t=keep)
        elif not attn_mask.node().mustBeNone():
            mask = attn_mask
        boolean = mask is not None and mask.type().scalarType() == "Bool"
        if boolean:
            mask = g.op("Where", mask, const(0.0), const(-math.inf))
        elif mask is not None and mask.type().scalarType() != kind:
            mask = g.op("Cast", mask, to_i=_ONNX_FLOAT[kind])
        if mask is not None:
            scores = g.op("Add", scores, mask)
        probs = g.op("Softmax", scores, axis_i=-1)
        if boolean:
            probs = g.op("Where", g.op("IsNaN", probs), const(0.0), probs)
        # dropout_p is ignored: an exported model is for inference, where dropout is off.
        return g.op("MatMul", probs, value)

    return sdpa


@contextlib.contextmanager
def half_attention(opset: int) -> Iterator[None]:
    """While exporting at ``opset``, attention keeps the dtype of its query
    (:func:`_sdpa_symbolic`); the exporter's own symbolic is back afterwards."""
    torch = _torch()
    torch.onnx.register_custom_op_symbolic(SDPA_OP, _sdpa_symbolic(), opset)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic(SDPA_OP, opset)


def export_onnx(
    name: str,
    prefix: str | os.PathLike[str],
    batch: int = 1,
    fp16: bool = False,
    opset: int = DEFAULT_OPSET,
    *,
    bf16: bool = False,
    options: Mapping[str, Any] | None = None,
    seed: int = SEED,
    device: str | None = None,
    check: bool = True,
    reference_cache: str | os.PathLike[str] | None = None,
) -> Path:
    """Build ``name`` and write ``PREFIX/model.onnx`` (TorchScript exporter, fixed shapes,
    constants folded), ``PREFIX/export.json`` and ``PREFIX/inputs.npz`` (the inputs, by
    graph input name); returns the path of model.onnx.

    The fixed shapes are deliberate: welder tunes for one shape, and symbolic dimensions
    would only have to be fixed again with --input-shape.  With ``check`` (the default)
    onnxruntime runs the graph on the export's inputs and every output must match the
    torch module's within welder's threshold for its dtype (:func:`check_outputs`), so a
    benchmark never times a graph that is not the module; the file is removed otherwise.
    With ``reference_cache`` onnxruntime's outputs stay there for test_acc's check of a
    build on inputs.npz (``--inputs``, ``--reference-cache``), which at batch 64 saves a
    run of minutes on the CPU."""
    torch = require_packages(name)
    dev = _pick_device(device)
    module, inputs = build_model(name, batch, fp16, bf16=bf16, options=options, seed=seed)
    out = Path(prefix)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    onnx_path = out / MODEL_ONNX
    module = module.to(dev)
    args = tuple(v.to(dev) for v in inputs.values())
    half = half_attention(opset) if fp16 or bf16 else contextlib.nullcontext()
    with warnings.catch_warnings(), torch.no_grad(), half, _exact_fp32():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            str(onnx_path),
            input_names=list(inputs),
            output_names=output_names(name),
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    dtype = "float16" if fp16 else "bfloat16" if bf16 else "float32"
    report: dict[str, Any] = {}
    named = dict(zip(inputs, args))
    feeds = graph_feeds(onnx_path, named)
    try:
        if fp16 or bf16:
            check_half_graph(onnx_path, dtype)
        if check:
            cache = None if reference_cache is None else Path(reference_cache)
            report = check_outputs(onnx_path, module, named, feeds, output_names(name), cache)
    except WelderError:
        onnx_path.unlink()
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    with replaced(out / INPUTS_NPZ) as partial:
        np.savez(partial, **feeds)
    info = ExportInfo(
        model=name,
        batch=batch,
        dtype=dtype,
        seed=seed,
        opset=opset,
        options=dict(options or {}),
        inputs={k: {"shape": list(v.shape), "dtype": _dtype_name(v)} for k, v in inputs.items()},
        outputs=output_names(name),
        versions=package_versions(name),
        check=report,
    )
    (out / EXPORT_JSON).write_text(info.to_json())
    return onnx_path


# -- rebuilding ----------------------------------------------------------------------------


def read_export(prefix: str | os.PathLike[str]) -> ExportInfo:
    """The ``export.json`` of PREFIX (a folder, or its model.onnx)."""
    p = Path(prefix)
    folder = p if p.is_dir() else p.parent
    path = folder / EXPORT_JSON
    if not path.is_file():
        raise WelderError(f"{path} not found; create it with: welder export MODEL --prefix {folder}")
    return ExportInfo.from_json(path.read_text())


def version_mismatches(info: ExportInfo) -> list[str]:
    """Packages whose version differs from the one that exported the model: the rebuilt
    module may then differ in its weights (latency comparisons stay meaningful)."""
    now = package_versions(info.model)
    return [
        f"{pkg} {was} at export, {now.get(pkg)} now"
        for pkg, was in info.versions.items()
        if pkg != "python" and now.get(pkg) != was
    ]


def rebuild(prefix: str | os.PathLike[str]) -> tuple[torch.nn.Module, Inputs, ExportInfo]:
    """The exported module and inputs again, from ``PREFIX/export.json``.  Checks that the
    inputs have the recorded names and shapes, so a changed registry is caught here
    rather than showing up as a mysterious timing or accuracy difference."""
    info = read_export(prefix)
    module, inputs = build_model(
        info.model,
        info.batch,
        info.dtype == "float16",
        bf16=info.dtype == "bfloat16",
        options=info.options,
        seed=info.seed,
    )
    got = {k: list(v.shape) for k, v in inputs.items()}
    want = {k: list(v["shape"]) for k, v in info.inputs.items()}
    if want and got != want:
        raise WelderError(f"rebuilt inputs {got} differ from those in {EXPORT_JSON} {want}")
    return module, inputs, info


def to_numpy(inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The inputs as numpy arrays, keyed by ONNX input name (for onnxruntime and welder);
    bfloat16 ones as ``ml_dtypes.bfloat16`` arrays (numpy itself has no such type)."""
    import ml_dtypes

    torch = _torch()
    out = {}
    for k, v in inputs.items():
        v = v.detach().cpu()
        out[k] = (
            v.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16 else v.numpy()
        )
    return out


def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` -> (key, value), the value read as JSON when it parses (``depth=2``,
    ``depths=[1,1,1,1]``, ``qkv_bias=false``) and as a string otherwise; an argparse
    ``type=`` for ``welder export --option``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE like seq_len=64, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def describe() -> str:
    """The registry as lines ``name  summary`` (for ``welder export --list``)."""
    width = max(len(n) for n in MODELS)
    return "\n".join(f"{spec.name:<{width}}  {spec.summary}" for spec in MODELS.values())
