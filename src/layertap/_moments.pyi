# layertap's C kernel for statistics (_moments.c): see layertap.stats

KERNELS: tuple[str, ...]  # the float32 row kernels this CPU runs, fastest first; "portable" last

def moments(
    data: int, outer: int, channels: int, inner: int, out: int, f64: bool, threads: int, kernel: int = 0, /
) -> int: ...
