"""Text-to-SQL RL on tinker-cookbook's types: generated SQLite data, sandboxed execution reward, a sweep driver."""
