"""The vocabulary below everything: `trainer/`, `profiling/` and `benchmarks/` import it, it imports none of them.

- `cli`: the settings parser, its checks and the one-line errors every command prints.
- `stages`: the roles and which adapters each stage puts on the shared base.
- `files`: atomic writes and folders, published with the user's umask.
- `provenance`: device, date, command, git revision and library versions for every result file.
"""
