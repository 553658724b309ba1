"""
How kernel.py's launches reach the GPU: the address tables that hand a kernel its sources, and
launches bound once compiled, through Triton's C launcher alone. Importing this file imports triton.

An address table. A kernel that reads a list of tensors reads them through a table of their int64
addresses: no copies. address_table(addresses, like) writes one on the device by _table_kernel,
TABLE_CHUNK addresses a launch, each the kernel's argument: nothing goes up from the host, which
never waits, and a CUDA graph captures the launch (it replays a kernel's arguments as captured; a
table copied up from host memory would be replayed from a host block freed since).

Bound launches. kernel[grid](...) costs the host ~10 µs a launch in Triton's JITFunction.run
(triton/runtime/jit.py: binding and specializing every argument, the cache key, the knobs, launch
metadata) before ~2 µs in its C launcher. launch(jit, grid, key, args, constexprs) sends a launch
whose key (a guard on its arguments, kernel.py's for its kernels: None to refuse) has compiled
straight to the C launcher of what Triton compiled for it; the first launch with a key goes through
kernel[grid] and binds the kernel Triton returns (_bind). The bound calls follow the launchers'
private layouts in triton 3.6 and 3.9 (triton/backends/nvidia/driver.py CudaLauncher); the tests
check that they pass the driver the bytes Triton's own launches do. Other versions never bind.

A key is a guard that fixes how Triton specializes every runtime argument (native_specialize_impl):
pointers 16-byte aligned ('D'); do_not_specialize ints in [0, 2^31) and not bools (i32; a bool is
u1); a float fp32; the addresses passed as arguments (a tuple's entries), specialized one by one,
multiples of 16 in [2^31, 2^63) (i64 'D': all_bind). The key holds what the guard leaves free: the
tensors' dtypes, the number of entries, the grid, the constexprs, TRITON_DEBUG. A launch the guard
refuses goes through kernel[grid], as every launch does with hooks set, interpreted, under a
Triton version not in CHECKED_TRITONS, or with BOUND_LAUNCHES off.
"""
import math
import sys
import types

import torch

try:
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.runtime import driver
except ImportError:
    if __name__ == "__main__":  # python launcher.py: one line, as every script's
        print("launcher.py: error: triton is not installed (pip install triton)", file=sys.stderr)
        raise SystemExit(2)
    raise

I32, I64 = 1 << 31, 1 << 63
TABLE_CHUNK = 64        # addresses one launch of _table_kernel writes into a table


# %% The address tables' kernel

@triton.jit(do_not_specialize=["offset"])
def _table_kernel(
    table_ptr,          # int64 address table
    offset,             # where these entries of it start
    entries,            # a tuple of TABLE_CHUNK addresses: the kernel's arguments, which a CUDA
                        # graph replays as captured
):
    for i in tl.static_range(len(entries)):
        tl.store(table_ptr + offset + i, entries[i])


# %% Bound launches
# The Triton versions whose C launcher layouts the tests check (_bind's two, the driver's bytes):
# under any other (3.2-3.4 lack launcher attributes _bind reads), and when TRITON_INTERPRET=1 was
# set before import (triton.jit then made interpreted functions), every launch goes through
# kernel[grid]
CHECKED_TRITONS = ("3.6", "3.9")
BOUND_LAUNCHES = (isinstance(_table_kernel, triton.runtime.JITFunction)
                  and ".".join(triton.__version__.split(".")[:2]) in CHECKED_TRITONS)
cache = {}              # (driver, device, id(kernel), key) -> its bound launch(stream, args)


def launch(jit, grid, key, args, constexprs):
    """jit[grid](*args, **constexprs), bound once a launch with `key` (None: launch unbound) has
    compiled. The driver is in the entry, held (no later driver can take its id): another one
    (the stand-in, then a GPU's) never calls what was bound under the first. The kernel is in it
    by id (hashing a JITFunction hashes its source), held by what is bound."""
    if key is None:
        jit[grid](*args, **constexprs)
        return
    active = driver.active
    device = active.get_current_device()
    entry = active, device, id(jit), key
    bound = cache.get(entry)
    if bound is not None:
        bound(active.get_current_stream(device), args)
        return
    compiled = jit[grid](*args, **constexprs)
    if compiled is not None:            # (None: knobs.runtime.jit_cache_hook skipped it)
        cache[entry] = _bind(jit, compiled, grid, args, constexprs, device)


def _bind(jit, compiled, grid, args, constexprs, device):
    """A launch(stream, args) of `compiled` that passes its launcher what JITFunction.run passes:
    the runtime args, then the constexprs in the kernel's parameter order (its binder's), which the
    launcher drops by the signature; no launch metadata and no hooks (unhooked)."""
    values = tuple(jit.device_caches[device][4](*args, **constexprs)[0].values())
    tail = values[len(args):]
    launcher = compiled.run                         # loads the module: a CudaLauncher
    function, metadata = compiled.function, compiled.packed_metadata
    gx, gy, gz = (*grid, 1, 1)[:3]
    # CudaLauncher.__call__ allocates scratch, adds gsan's arguments; wrap_handle_tensordesc wraps
    # the C launch for tensor descriptors: with none of them, the C launch is all it does
    direct = (launcher.global_scratch_size == 0 and launcher.profile_scratch_size == 0
              and not getattr(launcher, "gsan_enabled", False)
              and isinstance(launcher.launch, types.BuiltinFunctionType))
    c_launch, coop, pdl = launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl
    if direct and hasattr(launcher, "arg_annotations"):    # triton 3.9: one C launch, args a tuple
        annotations, signature = launcher.arg_annotations, launcher.kernel_signature

        def bound(stream, args):
            c_launch(gx, gy, gz, stream, function, coop, pdl, metadata, None, None, None, None,
                     None, annotations, signature, args + tail)
    elif direct:                                # triton 3.6: a C launch per kernel, args spread
        def bound(stream, args):
            c_launch(gx, gy, gz, stream, function, coop, pdl, None, None, metadata, None, None,
                     None, *args, *tail)
    else:
        def bound(stream, args):
            launcher(gx, gy, gz, stream, function, metadata, None, None, None, *args, *tail)
    bound.jit, bound.constexprs = jit, constexprs   # held: their ids, in the entry, stay theirs
    return bound


def unhooked(jit):
    """No pre-run, launch or pipeline hook: a launch would pass the launcher nothing a bound one
    does not (JITFunction.run calls empty HookChains, with metadata no hook reads)."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return not (jit.pre_run_hooks or getattr(enter, "calls", enter)
                or getattr(leave, "calls", leave) or runtime.add_stages_inspection_hook)


def all_bind(entries):
    """Whether every address passed as an argument is i64 'D': 16-byte aligned, in [2^31, 2^63)."""
    return I32 <= min(entries) and max(entries) < I64 and not math.gcd(*entries) & 15


# %% An address table's launches

def _table_key(table, entries):
    """_table_kernel's key for a launch writing `entries` into `table` (None: launch unbound): all
    of them i64 'D', the offset, below the table's length, i32."""
    if (BOUND_LAUNCHES and not table.data_ptr() & 15 and table.numel() < I32
            and all_bind(entries) and unhooked(_table_kernel)):
        return len(entries), table.dtype, knobs.runtime.debug
    return None


_TABLE_OPTIONS = dict(num_warps=1)


def address_table(addresses, like):
    """A table of these addresses on like's device, padded with the first to whole chunks, written
    by _table_kernel, TABLE_CHUNK entries a launch: one kernel variant serves every table."""
    entries = addresses + addresses[:1] * (-len(addresses) % TABLE_CHUNK)
    table = like.new_empty(len(entries), dtype=torch.int64)
    for offset in range(0, len(entries), TABLE_CHUNK):
        chunk = tuple(entries[offset:offset + TABLE_CHUNK])
        launch(_table_kernel, (1,), _table_key(table, chunk), (table, offset, chunk),
               _TABLE_OPTIONS)
    return table


if __name__ == "__main__":  # a library: kernel.py's launches use it
    print("launcher.py: error: the launches' library runs nothing; python -m scripts.bench_kernel "
          "--host measures them", file=sys.stderr)
    raise SystemExit(2)
