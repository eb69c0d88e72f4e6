"""What a conversion will do, decided once: the source's shape, the engine rules, the methods, the frozen plan."""
