"""LIP processes (level 1): the system calls, once, typed (`syscalls.py`), and the two ABIs
over them (`core_abi.py`: C, Rust and AssemblyScript modules' pointers; `component.py`: Python
LIPs' component values); a process and its fiber (`process.py`), the runtime's workers and
batch driver (`runtime.py`), per-process limits (`limits.py`), sleeping guests' timers
(`timers.py`) and operator tools (`tools.py`)."""
