"""How many times to measure what: the quick and the full plan."""

from __future__ import annotations

import dataclasses
import json

#: The start methods compared, in table order; ``forkserver+preload`` is raw torch with torch preloaded in the
#: fork server (``set_forkserver_preload(["torch"])``), the fair peer of mplaunch's forkserver, which does that.
METHOD_ORDER = ("fork", "forkserver", "forkserver+preload", "spawn")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Repeat counts and time limits. A slow cell (see ``Runner.slow_methods``: spawn, or forkserver without
    preloading, where every worker imports torch, ~2 s per launch on 2 cores) gets fewer repeats."""

    name: str
    rounds: int  # every cell runs once per round; ratios compare cells of the same round
    warm: int  # warm launches after the first, per cell (fast cells)
    warm_slow: int  # the same for slow cells
    gloo: int  # launches with a gloo group set up and torn down (fast cells)
    gloo_slow: int
    payload: int  # launches per result payload
    payload_large: int  # launches for the 512 MiB payload
    payload_peers: int  # launches per payload for peers (mplaunch gets `payload`/`payload_large`)
    baseline: int  # repeats of each in-process baseline
    imports: int  # fresh interpreters timing `import mplaunch` after `import torch`
    state: int  # GlobalState.capture().restore() calls
    peers_slow: bool  # also measure peers (not raw torch, not mplaunch) with their slow methods (spawn)
    launch_timeout: float = 120.0  # seconds one launch may take before it is abandoned
    cell_timeout: float = 600.0  # seconds one cell process may take before it is killed

    def warm_count(self, slow: bool) -> int:
        return self.warm_slow if slow else self.warm

    def gloo_count(self, slow: bool) -> int:
        return self.gloo_slow if slow else self.gloo

    def payload_count(self, kind: str, peer: bool) -> int:
        if peer:
            return self.payload_peers
        return self.payload_large if kind.startswith("512") else self.payload

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls(**json.loads(text))


QUICK = Plan(
    name="quick",
    rounds=1,
    warm=8,
    warm_slow=2,
    gloo=3,
    gloo_slow=0,
    payload=3,
    payload_large=2,
    payload_peers=1,
    baseline=5,
    imports=3,
    state=200,
    peers_slow=False,
    cell_timeout=150.0,
)
FULL = Plan(
    name="full",
    rounds=3,
    warm=30,
    warm_slow=4,
    gloo=10,
    gloo_slow=2,
    payload=7,
    payload_large=5,
    payload_peers=3,
    baseline=15,
    imports=9,
    state=2000,
    peers_slow=True,
)
