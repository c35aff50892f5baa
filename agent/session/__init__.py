"""A profile from attach to detach: the pipeline that runs the kernel probes (and the sampler in sampled mode),
samples them into the model, symbolizes, and records MALT's statistics and the history store."""
