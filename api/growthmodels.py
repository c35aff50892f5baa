"""JSON schema of `/growth` (api.routers.growth): `heapscope growth --format=json`'s document
(agent.model.growth.GrowthReport.to_json), field for field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from agent.model.growth import GrowthReport

Verdict = Literal["leak suspect", "grew then stopped", "growing", "churn", "shrinking", "flat", "too few samples"]


class LineTrendOut(BaseModel):
    start_B: int
    end_B: int
    bytes_per_s: float = Field(description="Theil-Sen's slope over the window.")
    trend: Literal["grows", "flat", "shrinks"]


class ProcessGrowthOut(BaseModel):
    verdict: Literal["heap grows", "grows outside the heap", "heap shrinks", "flat"]
    said: str = Field(description='The verdict in a sentence ("the heap is flat but RSS grows ...").')
    heap: LineTrendOut = Field(description="The useful heap (an estimate in sampled mode).")
    mapped: LineTrendOut | None = Field(description="Bytes mapped; null where the store did not keep them.")
    rss: LineTrendOut | None


class SiteGrowthOut(BaseModel):
    site: str = Field(description="`function (file:line)`: the allocation site, as Massif trims its stack.")
    verdict: Verdict
    suspect: bool = Field(description="A leak suspect: steady growth made of bytes that stay.")
    bytes_per_s: float = Field(description="Theil-Sen's slope of its live bytes over the window.")
    steadiness: float = Field(description="Share of the window's 8 sub-windows in which the bytes it kept rose.")
    age_s: float = Field(description="Bytes-weighted mean age of its live bytes, read from its series (at most "
                         "the window).")
    added_B: int = Field(description="Live bytes at the end less at the start of the window.")
    live_B: int
    samples: int | None = Field(description="Sampled mode: samples taken at the site over the window.")
    stack: list[str] = Field(description="Its stack that added the most: the site, then its callers outwards.")
    line: list[int] = Field(description="Its live bytes at each of `times_s`.")


class GrowthOut(BaseModel):
    """What is growing over a window of a target's stored history, sites ranked: leak suspects first, then by
    the bytes they added. agent/model/growth.py says how each figure and verdict is decided."""

    pid: int
    cmd: str
    mode: Literal["exact", "sampled"]
    sample_rate: int = Field(description="Sampled mode: mean bytes between samples; 1 in exact mode.")
    window_s: float
    start_wall_ns: int
    end_wall_ns: int
    snapshots: int = Field(description="Snapshots stored in the window.")
    points: int = Field(description="Snapshots read: at most 48, spread over the window.")
    times_s: list[float] = Field(description="The points, seconds from the window's start.")
    process: ProcessGrowthOut
    n_sites: int = Field(description="Sites judged (all of them; `sites` lists the top ones).")
    counts: dict[str, int] = Field(description="Sites of each verdict.")
    suspects: int
    sites: list[SiteGrowthOut]
    rest_bytes_per_s: float = Field(description="The sites not listed: their slopes summed.")
    notes: list[str] = Field(description="What the reader left out or could not judge well.")


def growth_out(report: GrowthReport) -> GrowthOut:
    return GrowthOut.model_validate(report.to_json())
