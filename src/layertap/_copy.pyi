# layertap's C copy with streaming stores (_copy.c): see layertap.tap

KERNELS: tuple[str, ...]  # the copies this CPU runs, fastest first; "portable" (memcpy) last

def copy(dst: int, src: int, nbytes: int, threads: int, kernel: int = 0, /) -> None: ...
