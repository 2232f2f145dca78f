"""The placement groups a run's supervisor reserves: named after the supervisor, and removed by the
driver when it kills the supervisor.

Ray scopes a placement group to the *job* that made it, not to the actor: a supervisor killed with its
groups standing (the driver's abort after a second Ctrl-C, an interrupt in a notebook, a test's timeout)
left its fleet's bundles reserved until the driver's process exited (measured: a killed actor's group
stays CREATED, its CPUs taken), and the next run in that session could not reserve its workers. Every
group a supervisor makes is named ``raysc-<its actor id>-<use>``; ``remove_groups_of`` removes the ones
still standing. Ray's own way out (a detached helper actor that watches the creator, as Ray Train does)
would be a process per run; the driver, which kills the supervisor, knows its id already.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

PREFIX = "raysc-"


def group_name(use: str) -> str:
    """The name for a placement group the calling actor (the supervisor) makes for ``use``."""
    return f"{PREFIX}{ray.get_runtime_context().get_actor_id()}-{use}"


def standing_groups(owner: str | None = None) -> dict[str, str]:
    """raysc's placement groups not yet removed (id -> name), those of the supervisor ``owner`` (an
    actor id in hex) only when given."""
    prefix = f"{PREFIX}{owner}-" if owner else PREFIX
    return {
        pg_id: info.get("name", "")
        for pg_id, info in placement_group_table().items()
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED"
    }


def remove_groups_of(owner: str) -> list[str]:
    """Remove the placement groups the supervisor ``owner`` left standing; returns their names."""
    groups = standing_groups(owner)
    for pg_id in groups:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    return sorted(groups.values())
