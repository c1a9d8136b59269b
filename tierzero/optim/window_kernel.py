"""The update of a window of low-bit optimizer state in one pass over memory: a small C++ loop,
built once per process with the machine's C++ compiler, that decodes the states of each 256-element
block, applies AdamW or SGD to the pieces of the window, and encodes the block back
([Note: fused state windows]). `eager_adamw_` and `eager_sgd_` are the same arithmetic in torch
ops, the path where no compiler is found or the tensors are not in the CPU's memory: the same bits.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from tierzero.layout import sqrt_
from tierzero.runtime import Held, Piece

# [Note: fused state windows]
# A low-bit window decoded to fp32, updated by torch's fused kernel and encoded back took some
# twenty passes of eager torch ops over memory, several times slower per parameter than fp32's
# one fused pass (RESULTS.md, "the CPU's update per state format"). Here one loop does the window:
# per QUANT_BLOCK block it widens the states into a 1 KiB buffer, updates the elements of the
# window's pieces (each with its row of hyper-parameters: its group's and its step count's), and
# stores them back, the master weights in place (bf16 ones rounded stochastically).
# Why a C++ loop built with the system compiler and loaded by ctypes, not torch.compile: both
# need a compiler, but inductor's first compile of this function takes tens of seconds (and
# seconds more from its disk cache, which the `tierzero` command removes after each run:
# [Note: private caches]), and its code ran slower; this file, with no torch header, compiles in
# under a second, into a private temporary folder that is removed once loaded (no cache another
# user could plant code in).
# The arithmetic is IEEE single precision with no fused multiply-add, in one fixed order; the
# eager path does the same operations in the same order, so both give the same bits (tested),
# and the bits depend on neither the tier nor the placement ([Note: state windows]).
# The formulas: AdamW as torch's fused CPU kernel orders it (without its fused multiply-adds),
#   p *= 1 - lr wd; m += (g - m)(1 - b1); v = v b2 + ((1 - b2) g) g;
#   p -= (lr / bc1 m) / (sqrt(v) / sqrt(bc2) + eps);
# SGD: g += wd p; b = b mu + g (the first step from zeros: b = g); p -= lr b.
SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef int64_t i64; typedef uint32_t u32; typedef uint16_t u16; typedef uint8_t u8;
static inline float f_of(u32 u) { float f; memcpy(&f, &u, 4); return f; }
static inline u32 bits_of(float f) { u32 u; memcpy(&u, &f, 4); return u; }
static inline float bf16_in(u16 h) { return f_of((u32)h << 16); }
static inline u16 bf16_nearest(float f) {
  u32 u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline u16 bf16_stochastic(float f, u32 index, u32 seed) {
  u32 h = index ^ seed;
  h = ((h >> 16) ^ h) * 0x45D9F3Bu;
  h = ((h >> 16) ^ h) * 0x45D9F3Bu;
  h = (h >> 16) ^ h;
  return (u16)((bits_of(f) + (h & 0xFFFFu)) >> 16);
}
enum { F32 = 0, BF16 = 1, INT8 = 2 };
enum { ADAMW = 0, SGD = 1 };
#define S2 16129.0f
#define U4 4228250624.0f
#define U2 65025.0f
#define FLOOR 1e-30f

struct Args {
  void *master; const void *grad; void *s0, *s1; float *sc0, *sc1;
  const i64 *pieces; i64 npieces; const float *table; i64 ncols;
  i64 lo, hi, numel, first; u32 seed; float gscale; int grad_bf16;
};

template <int OPT, int MF, int SF>
static inline void elements(const Args &a, i64 i0, i64 i1, const float *row, float *__restrict__ m,
                            float *__restrict__ v, float *__restrict__ r) {
  /* elements [i0, i1) of the shard; m and v: their states, widened (m[0] is element i0's); r:
     the square roots of the new v (an int8 second moment's encoding takes them) */
  float *__restrict__ pf = (float *)a.master; u16 *__restrict__ pb = (u16 *)a.master;
  const float *__restrict__ gf = (const float *)a.grad; const u16 *__restrict__ gb = (const u16 *)a.grad;
  const float gs = a.gscale;
  for (i64 i = i0; i < i1; i++) {
    float p = MF == F32 ? pf[i] : bf16_in(pb[i]);
    float g = (a.grad_bf16 ? bf16_in(gb[i]) : gf[i]) * gs;
    i64 k = i - i0;
    if (OPT == ADAMW) {
      p = p * row[0];
      float mm = m[k] + (g - m[k]) * row[1];
      float vv = v[k] * row[2] + (row[3] * g) * g;
      float root = __builtin_sqrtf(vv);
      float den = root / row[5] + row[6];
      p = p - (row[4] * mm) / den;
      m[k] = mm; v[k] = vv;
      if (SF == INT8) r[k] = root;
    } else {
      g = g + row[1] * p;
      if (SF >= 0 && row[3] != 0.0f) { float b = m[k] * row[2] + g; m[k] = b; g = b; }
      p = p - row[0] * g;
    }
    if (MF == F32) pf[i] = p; else pb[i] = bf16_stochastic(p, (u32)(a.first + i), a.seed);
  }
}

template <int SF>
static inline void widen(const void *s, i64 i0, i64 n, float *out) {
  for (i64 k = 0; k < n; k++)
    out[k] = SF == F32 ? ((const float *)s)[i0 + k] : bf16_in(((const u16 *)s)[i0 + k]);
}
template <int SF>
static inline void narrow(void *s, i64 i0, i64 n, const float *in) {
  for (i64 k = 0; k < n; k++) {
    if (SF == F32) ((float *)s)[i0 + k] = in[k]; else ((u16 *)s)[i0 + k] = bf16_nearest(in[k]);
  }
}
static inline void decode8(const void *codes, const float *scales, i64 b, int unsigned_, float *out) {
  if (unsigned_) {
    const u8 *q = (const u8 *)codes + b * 256; float k = scales[b] / U4;
    for (int j = 0; j < 256; j++) { float x = (float)q[j]; x = x * x; out[j] = (x * x) * k; }
  } else {
    const int8_t *q = (const int8_t *)codes + b * 256; float k = scales[b] / S2;
    for (int j = 0; j < 256; j++) { float x = (float)q[j]; out[j] = (x * __builtin_fabsf(x)) * k; }
  }
}
static inline void encode8(void *codes, float *scales, i64 b, int unsigned_, const float *in,
                           const float *root) {
  /* root: the square roots of `in` (an unsigned state's) */
  u32 top = 0;
  for (int j = 0; j < 256; j++) { u32 u = bits_of(in[j]) & 0x7FFFFFFFu; top = u > top ? u : top; }
  float s = f_of(top);
  scales[b] = s;
  if (unsigned_) {
    float inv = s > 0.0f ? U2 / __builtin_sqrtf(s) : 0.0f; u8 *q = (u8 *)codes + b * 256;
    for (int j = 0; j < 256; j++) {
      float y = root[j] * inv; y = y > FLOOR ? y : FLOOR;
      q[j] = (u8)(int32_t)__builtin_rintf(__builtin_sqrtf(y));
    }
  } else {
    float inv = s > 0.0f ? S2 / s : 0.0f; int8_t *q = (int8_t *)codes + b * 256;
    for (int j = 0; j < 256; j++) {
      float y = __builtin_fabsf(in[j]) * inv; y = y > FLOOR ? y : FLOOR;
      q[j] = (int8_t)(int32_t)__builtin_copysignf(__builtin_rintf(__builtin_sqrtf(y)), in[j]);
    }
  }
}

template <int OPT, int MF, int SF>
static void run(const Args &a) {
  float m[256], v[256], r[256];
  if (SF != INT8) {
    for (i64 k = 0; k < a.npieces; k++) {
      i64 lo = a.pieces[3 * k], hi = a.pieces[3 * k + 1];
      const float *row = a.table + a.pieces[3 * k + 2] * a.ncols;
      for (i64 i0 = lo; i0 < hi; i0 += 256) {
        i64 n = hi - i0 < 256 ? hi - i0 : 256;
        if (SF >= 0) widen<SF>(a.s0, i0, n, m);
        if (OPT == ADAMW) widen<SF>(a.s1, i0, n, v);
        elements<OPT, MF, SF>(a, i0, i0 + n, row, m, v, r);
        if (SF >= 0) narrow<SF>(a.s0, i0, n, m);
        if (OPT == ADAMW) narrow<SF>(a.s1, i0, n, v);
      }
    }
    return;
  }
  i64 k = 0;
  for (i64 b = a.lo / 256; b * 256 < a.hi; b++) {
    i64 start = b * 256, end = start + 256;
    decode8(a.s0, a.sc0, b, 0, m);
    if (OPT == ADAMW) decode8(a.s1, a.sc1, b, 1, v);
    i64 done = start;  /* elements before it are updated, or were left out and have their roots */
    while (k < a.npieces && a.pieces[3 * k] < end) {
      i64 lo = a.pieces[3 * k], hi = a.pieces[3 * k + 1];
      i64 i0 = lo > start ? lo : start, i1 = hi < end ? hi : end;
      if (OPT == ADAMW) for (i64 j = done; j < i0; j++) r[j - start] = __builtin_sqrtf(v[j - start]);
      elements<OPT, MF, SF>(a, i0, i1, a.table + a.pieces[3 * k + 2] * a.ncols, m + (i0 - start), v + (i0 - start),
                            r + (i0 - start));
      done = i1;
      if (hi > end) break;
      k++;
    }
    if (OPT == ADAMW) for (i64 j = done; j < end; j++) r[j - start] = __builtin_sqrtf(v[j - start]);
    encode8(a.s0, a.sc0, b, 0, m, m);
    if (OPT == ADAMW) encode8(a.s1, a.sc1, b, 1, v, r);
  }
}

/* one variant a library: TZ_OPT, TZ_MF (the master weights' format) and TZ_SF (the states', -1: none) by -D */
extern "C" void tz_window_update(void *master, const void *grad, int grad_bf16, float gscale, void *s0, void *s1,
                                 float *sc0, float *sc1, i64 lo, i64 hi, i64 numel, const i64 *pieces,
                                 i64 npieces, const float *table, i64 ncols, i64 first, u32 seed) {
  Args a = {master, grad, s0, s1, sc0, sc1, pieces, npieces, table, ncols, lo, hi, numel, first, seed,
            gscale, grad_bf16};
  run<TZ_OPT, TZ_MF, TZ_SF>(a);
}
"""

FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "none": -1}
OPTIMIZERS = {"adamw": 0, "sgd": 1}
_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint32]

Variant = tuple[str, str, str]
"""(optimizer, master weights' format, states' format or "none"): one library each."""

_lock = threading.Lock()
_built: dict[Variant, ctypes.CDLL | None] = {}
"""The variants built in this process (None: could not be built)."""
_eager = False
"""built_with(None): no kernel."""
_warned = False


def compiler() -> str:
    """The C++ compiler the kernel is built with: $CXX, else g++."""
    return os.environ.get("CXX") or "g++"


def _build(variant: Variant) -> ctypes.CDLL:
    """Compile SOURCE's `variant` into a private temporary folder, load it and remove the folder
    (the loaded library stays mapped). OSError or SubprocessError when it cannot be built.
    Each variant is built when first used, not all eleven at start."""
    cxx = shutil.which(compiler())
    if cxx is None:
        raise FileNotFoundError(f"no C++ compiler {compiler()!r} on PATH")
    optimizer, master, states = variant
    folder = Path(tempfile.mkdtemp(prefix="tierzero-kernel-"))
    try:
        (folder / "window.cpp").write_text(SOURCE)
        subprocess.run([cxx, "-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fno-trapping-math",
                        f"-DTZ_OPT={OPTIMIZERS[optimizer]}", f"-DTZ_MF={FORMATS[master]}", f"-DTZ_SF={FORMATS[states]}",
                        "-shared", "-fPIC", "-o", str(folder / "window.so"), str(folder / "window.cpp")],
                       check=True, capture_output=True, text=True, timeout=120)
        library = ctypes.CDLL(str(folder / "window.so"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    library.tz_window_update.argtypes = _ARGTYPES
    library.tz_window_update.restype = None
    return library


def library(optimizer: str, master: str, states: str) -> ctypes.CDLL | None:
    """The kernel for `optimizer` with master weights and states in these formats ("none": no
    states), built on first use, or None where it cannot be built: then one warning a process,
    and updates take the eager path (the same bits, slower)."""
    global _warned
    variant = (optimizer, master, states)
    with _lock:
        if _eager:
            return None
        if variant not in _built:
            try:
                _built[variant] = _build(variant)
            except (OSError, subprocess.SubprocessError) as e:
                _built[variant] = None
                if not _warned:
                    _warned = True
                    detail = str(getattr(e, "stderr", None) or e).strip()[:300]
                    warnings.warn(f"tierzero: the fused update of low-bit optimizer states could not be built with "
                                  f"{compiler()!r} ({detail}); bf16 and int8 states and bf16 master weights update "
                                  "with eager torch ops instead: the same bits, several times slower. Install a C++ "
                                  "compiler (g++) or point $CXX at one", RuntimeWarning, stacklevel=3)
        return _built[variant]


@contextlib.contextmanager
def built_with(cxx: str | None) -> Iterator[None]:
    """Within: kernels built afresh by compiler `cxx` ($CXX; None: none, the eager path); the
    previous kernels, warning and $CXX restored after."""
    global _built, _eager, _warned
    old, old_env = (_built, _eager, _warned), os.environ.get("CXX")
    with _lock:
        _built, _eager, _warned = {}, cxx is None, False
        if cxx is not None:
            os.environ["CXX"] = cxx
    try:
        yield
    finally:
        with _lock:
            _built, _eager, _warned = old
            if old_env is None:
                os.environ.pop("CXX", None)
            else:
                os.environ["CXX"] = old_env


def fits(tensors: Sequence[torch.Tensor], grad: torch.Tensor) -> bool:
    """Whether the kernel can work on these tensors in place: contiguous, in the CPU's memory."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in (*tensors, grad))


def for_held(optimizer: str, held: Held) -> ctypes.CDLL | None:
    """The kernel for an update holding `held` (BlockUpdate.held), or None: the eager path (no
    compiler, or tensors outside the CPU's memory)."""
    if not fits(held.tensors, held.grad):
        return None
    return library(optimizer, held.codecs[0].dtype, held.codecs[1].dtype if len(held.codecs) > 1 else "none")


def update_windows(lib: ctypes.CDLL, held: Held, windows: Sequence[tuple[Sequence[tuple[int, Sequence[Piece]]], int, int]],
                   steps: Sequence[int], row: Callable[[int, int], Sequence[float]], first: int, seed: int) -> None:
    """Update the windows of `held` (each: its batches of (class, pieces), its first element, one
    past its last piece's end) with `lib`; `row(class, step)`: a piece's hyper-parameters."""
    rows: dict[tuple[int, int], int] = {}
    cut = []
    for batches, lo, hi in windows:
        pieces = sorted((a, b, rows.setdefault((c, steps[j]), len(rows))) for c, ps in batches for a, b, j in ps)
        cut.append((lo, hi, torch.tensor(pieces, dtype=torch.int64)))
    table = torch.tensor([row(c, s) for c, s in rows], dtype=torch.float32)
    parts = [c.parts(t, held.numel) if c.dtype == "int8" else (t, None)
             for c, t in zip(held.codecs[1:], held.tensors[1:])]
    fused_windows(lib, held.tensors[0], held.grad, held.scale, [p[0] for p in parts], [p[1] for p in parts], cut,
                  held.numel, table, first, seed)


def fused_windows(lib: ctypes.CDLL, master: torch.Tensor, grad: torch.Tensor, scale: float | None,
                  states: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None], windows: Sequence[tuple[int, int, torch.Tensor]],
                  numel: int, table: torch.Tensor, first: int, seed: int) -> None:
    """Update the shard's `windows` in place with the kernel `lib` (`library`, of the tensors'
    formats; see the Note above), each (lo, hi, pieces):
    `pieces` an int64 [n, 3] tensor of (lo, hi, row) sorted by lo. `table`: a float32 [rows,
    columns] tensor of hyper-parameters (AdamW: 1 - lr wd, 1 - b1, b2, 1 - b2, lr / bc1,
    sqrt(bc2), eps; SGD: lr, wd, momentum, 1 if the group has momentum else 0). `states`: the
    stored tensors (int8: their codes, `scales` their scales); `first`: the shard's first
    element in the flat tensor, `seed`: the bf16 rounding's. The windows touch disjoint
    elements and blocks: torch's intra-op threads' worth of them run at once (the kernel runs
    without the GIL), each the same loop whichever thread takes it."""
    ptr = [s.data_ptr() for s in states] + [0] * (2 - len(states))
    sc = [s.data_ptr() if s is not None else 0 for s in scales] + [0] * (2 - len(scales))
    head = (master.data_ptr(), grad.data_ptr(), int(grad.dtype == torch.bfloat16), 1.0 if scale is None else scale,
            *ptr, *sc)

    def run(part: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        for lo, hi, pieces in part:
            lib.tz_window_update(*head, lo, hi, numel, pieces.data_ptr(), pieces.shape[0], table.data_ptr(),
                                 table.shape[1], first, seed & 0xFFFFFFFF)

    n = min(len(windows), torch.get_num_threads())
    if n <= 1:
        run(windows)
        return
    cut = [len(windows) * k // n for k in range(n + 1)]
    futures = [_pool(n).submit(run, windows[a:b]) for a, b in zip(cut[1:-1], cut[2:])]
    run(windows[:cut[1]])
    for future in futures:
        future.result()


_pools: dict[int, cf.ThreadPoolExecutor] = {}


def _pool(n: int) -> cf.ThreadPoolExecutor:
    """The threads that run windows beside the caller's (n - 1 of them)."""
    with _lock:
        if n not in _pools:
            _pools[n] = cf.ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="tierzero-window")
        return _pools[n]


def eager_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], rows: list[Sequence[float]]) -> None:
    """The kernel's AdamW on fp32 pieces, in torch ops, row by row (the same bits)."""
    for p, g, m, v, r in zip(params, grads, exp_avgs, exp_avg_sqs, rows):
        p.mul_(r[0])
        m.add_(g.sub(m).mul_(r[1]))
        v.mul_(r[2]).add_(g.mul(r[3]).mul_(g))
        p.sub_(m.mul(r[4]).div_(sqrt_(v.clone()).div_(r[5]).add_(r[6])))


def eager_sgd_(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor],
               rows: list[Sequence[float]]) -> None:
    """The kernel's SGD on fp32 pieces (`buffers` empty without momentum), in torch ops."""
    for k, (p, g, r) in enumerate(zip(params, grads, rows)):
        g = g.add(p.mul(r[1]))
        if buffers and r[3]:
            g = buffers[k].mul_(r[2]).add_(g)
        p.sub_(g.mul(r[0]))


def eager_update_(optimizer: str, grads: list[torch.Tensor], params: list[torch.Tensor],
                  *states: list[torch.Tensor], rows: list[Sequence[float]]) -> None:
    """`optimizer`'s window arithmetic on fp32 pieces in torch ops, a row per piece."""
    if optimizer == "adamw":
        eager_adamw_(params, grads, *states, rows)
    else:
        eager_sgd_(params, grads, states[0] if states else [], rows)
