"""The daemon (`heapscope serve`): targets attached and detached at run time, fleets chosen by selectors,
their files, history and the monitor commands. Uses the session layer; the API (api/) reaches it through ports."""
