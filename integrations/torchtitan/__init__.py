"""torchtitan integration (see the torchtitan issue); installed as upipe_compile.integrations.torchtitan."""
