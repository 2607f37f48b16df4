"""KV memory, knowing nothing of the model that fills it: the paged pool (`pool.py`), KVFS, the
file system of KV caches over it (`kvfs.py`), and automatic prefix reuse (`prefix_cache.py`)."""
