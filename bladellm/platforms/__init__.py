"""What the machine offers (ISA, cores, memory), read once at start-up."""
