"""The target process: discovery of its allocator, launching or attaching, the sampler library built and
injected with ptrace at a safe point, and its files seen through its own root (containers, chroots)."""
