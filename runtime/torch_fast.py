"""A loaded torch encoder made faster (``faster``): bfloat16 ``Linear`` weights packed once for
oneDNN, then the whole module traced and frozen.

- **Packed** (bfloat16, where oneDNN runs bfloat16 on this CPU): each ``Linear``'s weight is
  reordered once into the blocked layout oneDNN's matrix kernels read (AMX tiles on a Xeon
  with AMX), where ``F.linear`` reorders it on every call. Packed, all-MiniLM-L6-v2's
  answers on the 2-vCPU Xeon with AMX were identical at 1 and 2 threads at 205 of 208 shapes
  of real text (unpacked: 147; ``bench.precision_exactness``), but a sweep up to 512 padded
  tokens still found 278 of 1,778 shapes that differ (unpacked: 979), so mode 2 still serves
  no other count there (R4.8). Packing changes answers in the last bits at some shapes (a
  1,536-wide product of 3 x 24 rows), so it is part of the host fingerprint
  (``host.TORCH_ANSWERS``). The packed copy is the process's own memory (21 MB for
  all-MiniLM-L6-v2), not the file a worker and its shadow process both map; the mapped
  originals' pages are dropped from the process once packed (``weights.release_pages``).
  An attention's query, key and value projections are packed side by side as one product
  (``_fuse_projections``): one oneDNN call instead of three.
- **Traced**: TorchScript records the operators a forward runs, and its interpreter runs them
  without the profiling executor's optimizations (no fused kernels, no re-specialization per
  shape): the same aten operators in the same order, without transformers' Python between
  them. Kept only where it answers every probe (``PROBES``) bit for bit as the module it was
  traced from. Inputs longer than ``attention.MIN_TOKENS`` run that module itself: there
  ``attention.py`` takes branches on the data (blocks of a local window, each padded row's own
  keys) that a trace would keep from its short example, and the Python a trace saves is under
  2% of such a forward.
- **Frozen**: the trace's submodule calls are inlined into one graph and its weights read as
  constants (``_frozen``); the packed product is a TorchScript function, so no Python runs
  during a forward at all.

On the 2-vCPU Xeon, at one thread, one row of 8 tokens: bfloat16 4.8 ms as loaded, 3.3
traced, 3.0 packed and traced with the product a Python custom op, 2.5 with it a TorchScript
function, 2.3 frozen; float32 6.2 as loaded, 4.6 traced, 4.3 frozen (1 x 32: bfloat16 3.4,
2.8, 2.6); from 16 rows of 64 tokens on they tie (the operators' own time dominates).
``tests/test_torch_fast.py`` checks answers for every task and precision.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable

from vllm_srun.runtime.attention import MIN_TOKENS
from vllm_srun.runtime.precision import Precision

log = logging.getLogger("vllm_srun.runtime")

# Probes the traced module must answer bit for bit as the module it was traced from: (rows,
# tokens, padded rows, token types 0 and 1). One short row (the one-client case), a padded
# batch (rows cut short by the attention mask), a pair, one longer row (as long as the model
# takes, up to 200). The trace's own example: 2 x 16.
PROBES = ((1, 8, False, False), (3, 24, True, False), (2, 40, True, True),
          (1, 200, False, False))
EXAMPLE = (2, 16, False, False)

_packed_op = None  # compiled once per process (``_packed_linear``), under ``_registering``
_registering = threading.Lock()


def packs(precision: Precision) -> bool:
    """Whether ``faster`` packs ``Linear`` weights at ``precision`` on this CPU."""
    import torch

    return precision is Precision.BFLOAT16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def faster(module, precision: Precision, release: Callable[[list], object] | None = None):
    """``module`` (``torch_model.load_module``'s, on the CPU) packed where ``packs`` says so
    (logged where it cannot be), then traced where the trace answers as it does (logged
    otherwise). ``release(weights)``: called once with the weights packed copies replaced
    (their pages are no longer read: ``weights.release_pages``)."""
    import torch

    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarning: shape branches taken as traced
        if packs(precision):
            replaced = pack(torch, module)
            if replaced and release is not None:
                release(replaced)
        try:
            return _traced(torch, module)
        except Exception as exc:  # TorchScript raises many kinds; the module runs untraced
            log.warning("torch_trace_unused reason=%s", str(exc).splitlines()[0][:200])
            return module


def _probe(torch, config, rows: int, tokens: int, padded: bool, pairs: bool):
    tokens = min(tokens, getattr(config, "max_position_embeddings", 512) - 2)  # XLM-R: from 2
    g = torch.Generator().manual_seed(rows * 1000 + tokens)
    ids = torch.randint(min(5, config.vocab_size - 1), config.vocab_size, (rows, tokens),
                        generator=g)
    mask = torch.ones(rows, tokens, dtype=torch.long)
    types = torch.zeros(rows, tokens, dtype=torch.long)
    for i in range(1, rows if padded else 1):
        keep = max(2, tokens - 5 * i)
        mask[i, keep:], ids[i, keep:] = 0, 0
    if pairs and getattr(config, "type_vocab_size", 1) > 1:
        types[:, tokens // 2:] = 1
    return ids, mask, types


def _traced(torch, module):
    class TracedEncoder(torch.nn.Module):
        """A traced encoder with ``load_module``'s signature (token types optional)."""

        def __init__(self, script, source) -> None:
            super().__init__()
            self.script = script
            # a submodule: its tensors are the ones the frozen script reads (not copies), so
            # ``named_parameters`` names them
            self.source = source

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            if input_ids.shape[1] > MIN_TOKENS:
                return self.source(input_ids, attention_mask, token_type_ids)
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            # the flag is per OS thread: each lane's thread sets it for its own forwards
            with torch.jit.optimized_execution(False):
                return self.script(input_ids, attention_mask, token_type_ids)

    config = module.inner.config
    script = torch.jit.trace(module, _probe(torch, config, *EXAMPLE), check_trace=False,
                             strict=False)
    run = TracedEncoder(_frozen(torch, script.eval()), module).eval()
    for probe in PROBES:
        batch = _probe(torch, config, *probe)
        if not torch.equal(module(*batch), run(*batch)):
            log.warning("torch_trace_unused reason=differs probe=%s", probe)
            return module
    return run


def _frozen(torch, script):
    """``script`` with its submodules' methods inlined into one graph and its weights read as
    constants over the same storage (no copies): ``torch._C._freeze_module`` alone, without
    ``torch.jit.freeze``'s graph optimizations (they fuse and re-lay out float32 products,
    which copies weights and may change answers). Saves the interpreter's ~110 method calls
    and attribute reads a forward of the default model; where it fails, ``script`` as is."""
    from torch.jit._script import RecursiveScriptModule

    try:
        frozen = RecursiveScriptModule(torch._C._freeze_module(script._c, []))
        RecursiveScriptModule._finalize_scriptmodule(frozen)
    except Exception as exc:  # a private API of the pinned torch: keep the trace unfrozen
        log.warning("torch_freeze_unused reason=%s", str(exc).splitlines()[0][:200])
        return script
    return frozen


def weights(served) -> list:
    """The floating-point tensors the served module (``faster``'s) reads: a frozen trace's
    constants and the tensors its graph reads from submodules it kept (packed weights, which
    oneDNN keeps opaque, cannot be constants); else its parameters and buffers."""
    import torch

    script = getattr(served, "script", None)
    if script is None:
        return [*served.parameters(), *served.buffers()]
    graph = script.graph
    found = [*script.parameters(), *script.buffers()]
    held = {next(graph.inputs()).unique(): script._c}  # graph value -> the module it holds
    for node in graph.findAllNodes("prim::GetAttr"):  # in order: a holder before its reads
        owner = held.get(node.input().unique())
        if owner is not None:
            value = owner.getattr(node.s("name"))
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, torch._C.ScriptModule):
                held[node.output().unique()] = value
    found += _constants(torch, graph)
    return list({t._cdata: t for t in found if t.is_floating_point()}.values())


def _constants(torch, graph) -> list:
    constants = (node.output().toIValue() for node in graph.findAllNodes("prim::Constant"))
    return [c for c in constants if isinstance(c, torch.Tensor)]


def forget(served) -> None:
    """Empty the tensors a frozen trace of ``served`` (``faster``'s) reads as constants, so
    their memory goes once the module does. The frozen graph belongs to
    torch's global compilation unit, which keeps it after the module is gone, and with it
    every weight it reads as a constant: the float32 copy that answered the quality gate's
    reference stayed mapped and resident in a worker that served bfloat16 (462 MB for a
    ModernBERT-base-shaped model). Only for a module no forward will run again."""
    import torch

    script = getattr(served, "script", None)
    if script is None or not hasattr(script, "graph"):
        return
    with torch.inference_mode():
        for tensor in _constants(torch, script.graph):
            if tensor.layout is torch.strided:
                tensor.set_()  # the graph keeps an empty tensor; the storage is let go


def pack(torch, module) -> list:
    """Replace every bfloat16 ``Linear`` of ``module`` by one with its weight packed; where
    oneDNN refuses one, ``module`` stays as loaded. Returns the weights replaced."""
    op = _packed_linear(torch)

    class PackedLinear(torch.nn.Module):
        def __init__(self, linear) -> None:
            super().__init__()
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
                linear.weight.detach(), None))
            self.bias = linear.bias

        def forward(self, x):
            return op(x, self.packed, self.bias)

    swapped = []
    try:
        swapped += _fuse_projections(torch, op, module)
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear and child.weight.dtype == torch.bfloat16:
                    setattr(parent, name, PackedLinear(child))
                    swapped.append((parent, name, child))
    except Exception as exc:  # oneDNN refused a weight
        log.warning("torch_pack_unused reason=%s", str(exc).splitlines()[0][:200])
        for parent, name, child in swapped:
            setattr(parent, name, child)
            if hasattr(parent, FUSED):
                delattr(parent, FUSED)
        return []
    return [child.weight for _, _, child in swapped]


# An attention's query, key and value projections (BERT's names) read the same input: packed
# side by side they are one product, then split. Each output is the same sum over the same
# inputs as in its own product (bit for bit on the 2-vCPU Xeon, 1 and 2 threads), and one
# oneDNN call costs less than three: one row of 8 tokens, one thread, 35 against 63 us
# (53 against 72 at 32 tokens; the same from 1,024 tokens up).
PROJECTIONS = ("query", "key", "value")
FUSED = "fused_projections"


def _fuse_projections(torch, op, module) -> list:
    """Pack each module's ``PROJECTIONS`` (bfloat16 ``Linear`` layers over one input size)
    as one product, registered beside them as ``FUSED``; each projection becomes a part of
    it. Returns (parent, name, the ``Linear`` replaced) for each."""

    class Fused(torch.nn.Module):
        """The product of several ``Linear`` layers over one input. A part asks for its
        slice for an input (``part``): the first part computes them all, the others take
        theirs, so a trace records one product and its slices. (Run as loaded, another input
        in between, as from a second forward at once, computes again: never a stale slice.)"""

        def __init__(self, linears) -> None:
            super().__init__()
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
                torch.cat([lin.weight.detach() for lin in linears]), None))
            self.bias = (None if linears[0].bias is None else torch.nn.Parameter(
                torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False))
            self.widths = [lin.out_features for lin in linears]
            self._last: tuple | None = None  # (an input, its slices)

        def part(self, x, i: int):
            last = self._last
            if last is None or last[0] is not x:
                last = (x, op(x, self.packed, self.bias).split(self.widths, -1))
            # the last part ends the input's use: no tensor is held past it
            self._last = None if i == len(self.widths) - 1 else last
            return last[1][i]

    class Part(torch.nn.Module):
        def __init__(self, fused: Fused, i: int) -> None:
            super().__init__()
            self.i = i
            object.__setattr__(self, "fused", fused)  # not a submodule: its parent holds it

        def forward(self, x):
            return self.fused.part(x, self.i)

    swapped = []
    for parent in list(module.modules()):
        linears = [getattr(parent, name, None) for name in PROJECTIONS]
        if not all(type(lin) is torch.nn.Linear and lin.weight.dtype == torch.bfloat16
                   for lin in linears) or len({(lin.in_features, lin.bias is None)
                                               for lin in linears}) != 1:
            continue
        fused = Fused(linears)
        parent.add_module(FUSED, fused)
        for i, (name, lin) in enumerate(zip(PROJECTIONS, linears, strict=True)):
            setattr(parent, name, Part(fused, i))
            swapped.append((parent, name, lin))
    return swapped


def _packed_linear(torch):
    """oneDNN's linear on a packed weight as a TorchScript function: a trace records the
    operator itself (called from Python the operator takes an empty list TorchScript cannot
    type, and a Python custom op cost ~10 us a call, 0.4 ms of a short forward)."""
    global _packed_op
    with _registering:  # backends may load on several threads at once
        if _packed_op is None:
            _packed_op = torch.jit.CompilationUnit(_PACKED_LINEAR).packed_linear
    return _packed_op


_PACKED_LINEAR = """
def packed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    no_scalars: List[Optional[number]] = []
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", no_scalars, "")
"""
