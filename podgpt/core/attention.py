"""
Attention for podgpt's GPT: the masks (a Mask says once who sees whom; each kernel's form of it and
the float64 reference derive from it), the kernels (FlashAttention 3 / 2, PyTorch's SDPA held to one
kernel or left to choose, FlexAttention, FlashAttention 4 through SDPA), and attention(), which
runs an attn_backend; "auto" resolves to the fastest that runs here and agrees with float64.
"""

import importlib
import importlib.util
import math
import warnings
from functools import lru_cache, partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from podgpt.core.util import dtype_name, first_line

# fastest first: the order attn_backend="auto" tries them in
ATTENTION_BACKENDS = ("fa3", "fa2", "cudnn", "flash", "efficient", "flex", "math")
# run only when attn_backend names them, never auto's pick: fa4 is a beta package, and turning it
# on swaps SDPA's flash kernel for the whole process
OPT_IN_BACKENDS = ("fa4",)

# -----------------------------------------------------------------------------
# attention kernels: (q, k, v) are (B, heads, T, head_dim); k and v may have fewer heads (GQA:
# query head h reads key/value head h // (n_head / n_kv_head)). `causal`: True (aligned
# bottom-right when there are more keys than queries: the KV cache's), False for no mask, or a
# (T_q, T_k) bool tensor, True where a query may attend (SDPA kernels only). `mask`: None or a
# Mask, which then decides alone who sees whom (Documents, or a research objective's own).

class Mask:
    """Who sees whom, said once by allowed(); each kernel's form of it (FORMS: backend -> form) is
    made on first use and kept, so every layer and recomputation of a batch reuses it."""
    kind = None  # its name where resolve_backend takes a kind of mask (masks())
    FORMS = {}  # the backends that can take it, and the form each takes
    refusal = ""  # a backend outside FORMS "cannot {refusal}"
    label = ""  # what a refusal adds to "Available here (device, dtype, head_dim...)"
    flex_first = False  # auto tries flex first: only FlexAttention skips the mask's empty tiles
    positions = None  # the rows' RoPE positions, when they are not 0..T-1

    def __init__(self, rows, length, device):
        self.rows, self.length, self.device = rows, length, device  # rows None: all rows alike
        self.made = {}

    def get(self, form):
        if form not in self.made:
            self.made[form] = getattr(self, form)()
        return self.made[form]

    def allowed(self, q, kv, b=None):
        """True where query position q of row b may attend key position kv (broadcast indices)."""
        raise NotImplementedError

    def matrix(self):
        """(rows, T, T) bool, allowed() at every pair (one row when all are alike)."""
        i = torch.arange(self.length, device=self.device)
        b = torch.arange(self.rows or 1, device=self.device)[:, None, None]
        return self.allowed(i[:, None], i, b).expand(self.rows or 1, self.length, self.length)

    def dense(self):
        """(rows, 1, T, T) bool for SDPA."""
        return self.matrix()[:, None]

    def block(self):
        """FlexAttention's BlockMask: tiles where nothing is allowed are skipped."""
        from torch.nn.attention.flex_attention import create_block_mask
        return create_block_mask(lambda b, h, q, kv: self.allowed(q, kv, b), self.rows, None,
                                 self.length, self.length, device=self.device)


class Documents(Mask):
    """Causal attention within documents: doc_ids (B, T) is the document of every token."""
    kind, refusal, label = "documents", "mask documents (doc_mask=True)", ", doc_mask"
    # SDPA's flash kernel takes no mask on CUDA, and cudnn's support of one varies by release
    FORMS = {"fa3": "varlen", "fa2": "varlen", "flex": "block", "efficient": "dense",
             "math": "dense", "sdpa": "dense"}

    def __init__(self, doc_ids):
        super().__init__(doc_ids.size(0), doc_ids.size(1), doc_ids.device)
        self.ids = doc_ids

    def allowed(self, q, kv, b):
        return (q >= kv) & (self.ids[b, q] == self.ids[b, kv])

    def varlen(self):
        """(cu_seqlens, longest) for FlashAttention's varlen kernels, each document of each row one
        sequence of the flattened batch; the longest costs a host sync per batch."""
        B, T = self.ids.shape
        starts = torch.ones_like(self.ids, dtype=torch.bool)
        starts[:, 1:] = self.ids[:, 1:] != self.ids[:, :-1]
        first = starts.flatten().nonzero().flatten()
        cu_seqlens = torch.cat([first, first.new_tensor([B * T])]).to(torch.int32)
        return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())

    @classmethod
    def example(cls, T, device):
        """Two rows of T positions: three documents in one, one in the other."""
        doc_ids = torch.zeros(2, T, dtype=torch.long, device=device)
        doc_ids[0, T // 3:] += 1
        doc_ids[0, T // 2 + 5:] += 1
        return cls(doc_ids)


def masks():
    """{kind: Mask subclass}, a research objective's among them once its module is imported."""
    return {cls.kind: cls for cls in Mask.__subclasses__()}


def sdpa_attention(q, k, v, causal, mask=None):
    """PyTorch's scaled_dot_product_attention, on the kernel it picks (or sdpa_kernel pins)."""
    dense, is_causal = None, False
    if mask is not None:
        dense = mask.get("dense")
    elif isinstance(causal, torch.Tensor):
        dense = causal
    elif causal and q.size(2) == k.size(2):
        is_causal = True
    elif causal and q.size(2) > 1:  # is_causal aligns top-left: bottom-right spelled out
        dense = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril(
            k.size(2) - q.size(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, is_causal=is_causal,
                                          enable_gqa=k.size(1) != q.size(1))


def pinned_sdpa(kernel, q, k, v, causal, mask=None):
    with sdpa_kernel([kernel]):
        return sdpa_attention(q, k, v, causal, mask)


def flash_sdpa(impl, q, k, v, causal, mask=None):
    """SDPA's flash kernel as `impl` implements it: None, PyTorch's own (flash); "FA4" (fa4). The
    swap is process-wide, so each call puts back its own; a compiled graph calls whichever is
    active, which the eager trial call that resolved the backend set before any tracing."""
    if q.is_cuda and not torch.compiler.is_compiling():
        registry = torch.nn.attention  # before torch 2.10 there is none: PyTorch's is the only one
        if getattr(registry, "current_flash_attention_impl", lambda: None)() != impl:
            if impl is None:
                registry.restore_flash_attention_impl()
            else:
                registry.activate_flash_attention_impl(impl)
    return pinned_sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal, mask)


# name: (module, what it is, how to get it). fa4: torch 2.10+ routes SDPA's flash kernel to
# flash_attn.cute (flash-attn-4: CuTe DSL kernels compiled at first use) on Hopper and Blackwell
FLASH_PACKAGES = {
    "fa3": ("flash_attn_interface", "FlashAttention 3",
            "build it from flash-attention's hopper/ folder: cd hopper && python setup.py install"),
    "fa2": ("flash_attn", "FlashAttention 2", "pip install flash-attn --no-build-isolation"),
    "fa4": ("flash_attn.cute", "FlashAttention 4", "pip install --pre flash-attn-4"),
}
# name: (the compute capabilities' majors it runs on, lowest and highest, as said, what to use else)
FLASH_GPUS = {"fa3": (9, 9, "is built for Hopper, compute capability 9.0", ": use fa2"),
              "fa2": (8, 99, "needs compute capability 8.0 (Ampere) or newer", ""),
              "fa4": (9, 10, "runs on Hopper (compute capability 9.0) and Blackwell (10.x)",
                      ": use fa2 or flash")}


def flash_attention(name, q, k, v, causal, mask=None):
    """FlashAttention 2 or 3: (B, T, heads, head_dim) layout, GQA native, causal aligned
    bottom-right; documents through the varlen kernel, each document its own sequence."""
    if isinstance(causal, torch.Tensor):
        raise ValueError(f"attn_backend={name} takes causal=True or False, not a mask tensor: use "
                         f"an SDPA backend")
    module = importlib.import_module(FLASH_PACKAGES[name][0])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if mask is None:
        out = module.flash_attn_func(q, k, v, causal=causal)
    else:
        B, T = q.shape[:2]
        cu_seqlens, longest = mask.get("varlen")
        q2, k2, v2 = (t.reshape(B * T, *t.shape[2:]) for t in (q, k, v))
        out = module.flash_attn_varlen_func(q2, k2, v2, cu_seqlens_q=cu_seqlens,
                                            cu_seqlens_k=cu_seqlens, max_seqlen_q=longest,
                                            max_seqlen_k=longest, causal=True)
    out = out[0] if isinstance(out, tuple) else out  # some releases also return the log-sum-exp
    return out.view(q.shape[:2] + out.shape[-2:]).transpose(1, 2)


@lru_cache(maxsize=16)
def causal_block_mask(q_len, kv_len, device):
    from torch.nn.attention.flex_attention import create_block_mask
    offset = kv_len - q_len
    return create_block_mask(lambda b, h, q, kv: q + offset >= kv, None, None, q_len, kv_len,
                             device=device)


@lru_cache(maxsize=1)
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def flex_attention(q, k, v, causal, mask=None):
    """FlexAttention with a block mask, compiled for training's shapes on CUDA (eager, it computes
    the whole score matrix); the KV cache's changing shapes would each compile anew: eager."""
    from torch.nn.attention.flex_attention import flex_attention as eager
    if isinstance(causal, torch.Tensor):
        raise ValueError("attn_backend=flex takes causal=True or False, not a mask tensor: use an "
                         "SDPA backend")
    block_mask = None
    if mask is not None:
        block_mask = mask.get("block")
    elif causal and q.size(2) > 1:  # one query (the KV cache's next token) sees every key
        block_mask = causal_block_mask(q.size(2), k.size(2), q.device)
    gqa = k.size(1) != q.size(1)
    if q.is_cuda and q.size(2) == k.size(2):
        return compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    # eager on purpose: torch's warning (slow, and "may produce incorrect results", which concerns
    # only its debug mode) would alarm every sampler run; the logits equal math's (tested)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        return eager(q, k, v, block_mask=block_mask, enable_gqa=gqa)


ATTENTION_KERNELS = {
    "fa3": partial(flash_attention, "fa3"),
    "fa2": partial(flash_attention, "fa2"),
    "fa4": partial(flash_sdpa, "FA4"),
    "cudnn": partial(pinned_sdpa, SDPBackend.CUDNN_ATTENTION),
    "flash": partial(flash_sdpa, None),
    "efficient": partial(pinned_sdpa, SDPBackend.EFFICIENT_ATTENTION),
    "flex": flex_attention,
    "math": partial(pinned_sdpa, SDPBackend.MATH),
    "sdpa": sdpa_attention,
}
# largest error over largest value against float64, per compute dtype: a right kernel is well
# inside (CPU: 1.2e-2 in bf16, 1.4e-3 in fp16, 1e-6 in fp32), a wrong one (scale, mask, GQA) ~1 off
PARITY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def parity_tolerance(dtype, device):
    """PARITY_TOLERANCE of dtype, float16's for float32 on a GPU whose fp32 matmuls run in TF32
    (10-bit mantissa: an H200 measured math at 8.0e-4 and flex at 2.3e-3 there)."""
    tf32 = device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
    return PARITY_TOLERANCE.get(torch.float16 if dtype == torch.float32 and tf32 else dtype, 1e-4)


def reference_attention(q, k, v, mask=None):
    """Causal attention (or as a Mask allows) in float64, written out: the kernels' yardstick."""
    rep = q.size(1) // k.size(1)
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    T = q.size(2)
    allowed = (torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if mask is None else
               mask.matrix()[:, None])
    scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def parity_errors(name, device, dtype, head_dim, mask=None, n_head=4, n_kv_head=2, T=None):
    """Largest error of a kernel's output and q/k/v gradients ({output, dq, dk, dv}) against
    reference_attention, relative to the largest value, on random inputs rounded to dtype first
    (only the kernel's error counts), causal or under Mask.example of kind `mask`. T None: 256 on a
    GPU (past FlexAttention's and FlashAttention's 128-row tiles), 64 on a CPU."""
    device = torch.device(device)
    T = T or (256 if device.type == "cuda" else 64)
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, h, T, head_dim, generator=g, dtype=torch.float64)
                     .to(device, dtype) for h in (n_head, n_kv_head, n_kv_head, n_head))
    example = None if mask is None else masks()[mask].example(T, device)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_in, example)
    ref.backward(grad.double())
    test_in = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ATTENTION_KERNELS[name](*test_in, True, example)
    out.backward(grad)
    with torch.no_grad():
        pairs = [(out, ref)] + [(t.grad, r.grad) for t, r in zip(test_in, ref_in, strict=True)]
        return {part: ((a.double() - b).abs().max() / b.abs().max()).nan_to_num(math.inf).item()
                for part, (a, b) in zip(("output", "dq", "dk", "dv"), pairs, strict=True)}


def parity_error(name, device, dtype, head_dim, mask=None):
    """The largest of parity_errors at the default shapes: what auto holds to PARITY_TOLERANCE."""
    return max(parity_errors(name, device, dtype, head_dim, mask).values())


def flash_unavailable(name, device, dtype, head_dim):
    """Why FlashAttention 3, 2 or 4 (FLASH_PACKAGES) cannot run here, or None."""
    module, label, install = FLASH_PACKAGES[name]
    impls = getattr(torch.nn.attention, "list_flash_attention_impls", list)()  # torch 2.10+
    if name == "fa4" and "FA4" not in impls:
        return (f"{label} runs through SDPA from torch 2.10 on "
                f"(torch.nn.attention.activate_flash_attention_impl); this is torch "
                f"{torch.__version__}: upgrade torch, or use fa3, fa2 or flash")
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{module} is not installed ({label}): {install}"
    if device.type != "cuda":
        return f"{label} is CUDA only; this is {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{label} computes in bfloat16 or float16, not {dtype_name(dtype)}"
    major, minor = torch.cuda.get_device_capability(device)
    lowest, highest, gpus, fix = FLASH_GPUS[name]
    if not lowest <= major <= highest:
        return f"{label} {gpus}; this GPU is {major}.{minor}{fix}"
    fa4 = name == "fa4"
    if head_dim % 8 or head_dim > 256 or (fa4 and major == 10 and 128 < head_dim < 256):
        return (f"{label} takes a head_dim that is a multiple of 8 up to 256"
                f"{' (Blackwell: up to 128, or 256)' if fa4 else ''}, not {head_dim}")
    try:  # flash_attn may be FlashAttention 2 alone, without fa4's cute kernels
        imported = importlib.import_module(module + ".interface" if fa4 else module)
    except ImportError as e:
        return (f"{module} does not import ({first_line(e)}): {install}" if fa4 else
                f"{module} is installed but does not import ({first_line(e)}): reinstall it for "
                f"this torch")
    if not (fa4 or hasattr(imported, "flash_attn_func")):
        return (f"{module} has no flash_attn_func (flash-attn-4 alone installs only "
                f"flash_attn.cute): {install}")
    return None


def backend_unavailable(name, device, dtype, head_dim, mask=None):
    """None when attention backend `name` can train here (under a mask of kind `mask`), else one
    line saying why not and what would fix it."""
    device = torch.device(device)
    if name not in ATTENTION_KERNELS:
        return (f"unknown attention backend {name!r}: choose auto or one of "
                f"{', '.join(ATTENTION_KERNELS)}")
    if mask is not None and name not in masks()[mask].FORMS:
        return f"{name} cannot {masks()[mask].refusal}; {', '.join(masks()[mask].FORMS)} can"
    if name in FLASH_PACKAGES and (why := flash_unavailable(name, device, dtype, head_dim)):
        return why
    if name == "flex":
        if device.type != "cuda":
            return "FlexAttention has no backward pass on CPU: it trains on CUDA only"
        if importlib.util.find_spec("triton") is None:
            return ("FlexAttention compiles Triton kernels and triton is not installed: pip "
                    "install triton")
        return None  # a trial would compile kernels: auto's parity check or sanity.py runs one
    elif name in ("cudnn", "efficient") and device.type != "cuda":
        return f"the {name} kernel is CUDA only; this is {device.type}"
    elif name in ("math", "sdpa"):
        return None  # PyTorch's math kernel runs everywhere
    return trial_call(name, device, dtype, head_dim, mask)


def trial_call(name, device, dtype, head_dim, mask):
    """A tiny causal GQA forward and backward: None when it runs, else why not (SDPA says why it
    refuses a kernel in warnings)."""
    g = torch.Generator().manual_seed(0)  # not the global RNG: resolving must not change the init
    q, kv = (torch.randn(2, h, 16, head_dim, generator=g).to(device, dtype).requires_grad_()
             for h in (2, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            example = mask and masks()[mask].example(16, device)
            ATTENTION_KERNELS[name](q, kv, kv, True, example).sum().backward()
            return None
        except Exception as e:  # whatever a kernel raises, it cannot train here
            texts = (str(w.message).split(" (Triggered internally")[0] for w in caught)
            why = "; ".join(dict.fromkeys(" ".join(t.split()) for t in texts)) or first_line(e)
    return f"{name} cannot run {dtype_name(dtype)} with head_dim {head_dim} here: {why[:400]}"


resolved = {}  # (name, device type, dtype, head_dim, mask) -> (backend, note)


def resolve_backend(name, device, dtype, head_dim, mask=None):
    """(backend, note): the kernel attn_backend=name runs here (under a mask of kind `mask`), and
    why. "auto": the first of ATTENTION_BACKENDS that runs and agrees with float64, the note naming
    those skipped and why. A named backend that cannot run is a ValueError naming those that can."""
    if mask not in (None, *masks()):
        raise ValueError(f"mask={mask!r}: None or one of {', '.join(masks())}")
    key = (name, torch.device(device).type, dtype, head_dim, mask)
    if key not in resolved:
        # trial and parity runs are eager work, never part of a compiled graph (disabling
        # compilation at import would import torch._dynamo, a second, into every process)
        resolve = (torch.compiler.disable(resolve_uncached) if torch.compiler.is_compiling() else
                   resolve_uncached)
        resolved[key] = resolve(*key)
    return resolved[key]


def resolve_uncached(name, device_type, dtype, head_dim, mask):
    # they run forward and backward in their own dtypes, whatever the caller's grad and autocast
    no_autocast = torch.autocast(device_type, enabled=False)
    with torch.inference_mode(False), torch.enable_grad(), no_autocast:
        return resolve_in_eager(name, torch.device(device_type), dtype, head_dim, mask)


def resolve_in_eager(name, device, dtype, head_dim, mask):
    if name != "auto":
        why = backend_unavailable(name, device, dtype, head_dim, mask)
        if why is None:
            return name, f"{name}: as configured"
        here = [b for b in ATTENTION_KERNELS
                if b != name and not backend_unavailable(b, device, dtype, head_dim, mask)]
        raise ValueError(f"attn_backend={name} cannot run here: {why}. Available here "
                         f"({device.type}, {dtype_name(dtype)}, head_dim {head_dim}"
                         f"{masks()[mask].label if mask else ''}): {', '.join(here) or 'none'}")
    skipped, tol = [], parity_tolerance(dtype, device)
    flex_first = mask is not None and masks()[mask].flex_first
    for candidate in sorted(ATTENTION_BACKENDS, key=lambda b: flex_first and b != "flex"):
        why = backend_unavailable(candidate, device, dtype, head_dim, mask)
        if why is None:
            try:
                err = parity_error(candidate, device, dtype, head_dim, mask)
                why = (None if err <= tol else
                       f"largest error {err:.1e} against float64, over {tol:g}")
            except Exception as e:  # a kernel that fails its first real call is skipped, saying how
                why = f"failed its parity check: {first_line(e)}"
        if why is None:
            return candidate, (f"auto: {candidate} (largest error {err:.1e} against float64)"
                               + "".join(f"; skipped {s}" for s in skipped))
        skipped.append(f"{candidate} ({why})")
    raise ValueError("attn_backend=auto: no attention backend runs here: " + "; ".join(skipped))


def attention(backend, q, k, v, causal, mask=None):
    """Attention of q (B, Hq, T, D) over k, v (B, Hkv, T', D) on `backend` (an attn_backend value).
    mask: None, a Mask, or a (B, T) tensor of each token's document. The first call resolves the
    backend, running a backward of its own: call resolve_backend first under a checkpoint."""
    if isinstance(mask, torch.Tensor):
        mask = Documents(mask)
    if isinstance(mask, Documents) and causal is not True:
        raise ValueError("doc_ids makes attention causal within each document: pass causal=True")
    kind = None if mask is None else mask.kind
    name = resolve_backend(backend, q.device, q.dtype, q.size(-1), kind)[0]
    return ATTENTION_KERNELS[name](q, k, v, causal, mask)
