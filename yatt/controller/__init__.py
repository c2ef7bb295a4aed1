"""The rank's controller shard: its prompts, its samples, and global scalars by reduction."""
