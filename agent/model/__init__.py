"""The model: options, counters, stacks and trees, Massif's snapshot series and schedule, pages and maps, MALT's
profile, sampling estimates, fleets and growth. Pure Python, testable without root."""
