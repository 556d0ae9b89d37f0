"""Configuration keywords of glake.torch.enable() and the environment variables they set."""

# Keyword -> environment variable the library reads at pool creation.
ENVIRONMENT = {
    "stitch": "GLAKE_STITCH",
    "frag_limit": "GLAKE_FRAG_LIMIT",
    "reuse_limit": "GLAKE_REUSE_LIMIT",
    "defrag_level": "GLAKE_DEFRAG_LEVEL",
    "auto_gc": "GLAKE_AUTO_GC",
    "memory_fraction": "GLAKE_MEMORY_FRACTION",
    "memory_limit": "GLAKE_MEMORY_LIMIT",
    "max_stitch_pieces": "GLAKE_MAX_STITCH_PIECES",
    "max_chunk": "GLAKE_MAX_CHUNK",
    "chunk_divisor": "GLAKE_CHUNK_DIVISOR",
    "segment_handles": "GLAKE_SEGMENT_HANDLES",
    "gather": "GLAKE_GATHER",
    "grow_stitched": "GLAKE_GROW_STITCHED",
    "time_calls": "GLAKE_TIME_CALLS",
    "log": "GLAKE_LOG",
}

# GMLake's spellings, accepted as keywords too.
ALIASES = {
    "vmmDefragment": "stitch",
    "fragLimit": "frag_limit",
    "fragment_limit": "frag_limit",
    "reuseLimit": "reuse_limit",
    "defragLevel": "defrag_level",
    "defragment_level": "defrag_level",
    "autoGC": "auto_gc",
    "auto_gc_limits": "auto_gc",
}


def _text(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def environment(**config):
    """The environment variables that `enable(**config)` sets; TypeError on an unknown key."""
    env = {}
    for key, value in config.items():
        name = ALIASES.get(key, key)
        if name not in ENVIRONMENT:
            known = ", ".join(sorted(set(ENVIRONMENT) | set(ALIASES)))
            raise TypeError(f"unknown glake option {key!r}; known: {known}")
        env[ENVIRONMENT[name]] = _text(value)
    return env
