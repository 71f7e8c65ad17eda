"""The project's shape: the import graph's rules, module and function lengths, names, and
the package as built (version, wheel contents)."""
