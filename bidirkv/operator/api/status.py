"""The status of a DisaggregatedInference, as the CRD declares it."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from bidirkv.operator.api.base import _Model


class DrainingPod(_Model):
    name: str = Field(description="The pod.")
    deadline: str = Field(
        description="When its drain ends at the latest (RFC 3339): its launcher then stops "
        "the engine, whatever it still holds.")
    timed_out: bool = Field(
        default=False,
        description="The pod was still there at its deadline: its drain ran out. A decode "
        "pod's conversations it still held recompute their history on their next turn; a "
        "prefill pod's legs in flight fail.")
    conversations: int | None = Field(
        default=None, ge=0,
        description="The conversations a decode pod still holds (requests retained for a "
        "later turn that has not come back), as the operator last read them from its "
        "engine's vllm:bidirkv_retained_requests gauge; absent until a read succeeded. "
        "Past the deadline: what it held when its drain ran out.")


class RoleStatus(_Model):
    desired: int = Field(default=0, description="Pods the spec asks for.")
    replicas: int = Field(default=0, description="Pods that exist.")
    ready: int = Field(default=0, description="Pods whose engine serves the model.")
    updated: int = Field(default=0, description="Pods running the current template.")
    summary: str = Field(default="0/0", description="`ready/desired`, for printer columns.")
    selector: str = Field(default="", description="Label selector of the pods (for HPA).")
    draining: int = Field(
        default=0,
        description="Pods that are leaving (deleted: a rollout, a scale-down, a node drain, "
        "an eviction) and drain before they stop: a decode pod until each conversation it "
        "holds came back or was released, a prefill pod until its legs in flight are done.")
    draining_pods: list[DrainingPod] = Field(
        default_factory=list, description="The draining pods, each with its deadline.")
    draining_conversations: int | None = Field(
        default=None, ge=0,
        description="Conversations the draining pods still hold, summed over the pods "
        "whose count was read (decode only; absent when none was).")
    draining_summary: str = Field(
        default="0",
        description="Draining pods and the conversations they hold, for printer columns: "
        "`0`, `2` (counts unknown), `2 (5 held)`, or `2 (5+ held)` when a pod's count is "
        "unknown.")


class Condition(_Model):
    type: str = Field(description="Condition type.")
    status: str = Field(pattern="^(True|False|Unknown)$", description="True, False, Unknown.")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str = Field(description="When the status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, description="Generation seen.")


class Phase(StrEnum):
    Pending = "Pending"
    Progressing = "Progressing"
    Ready = "Ready"
    Degraded = "Degraded"
    Invalid = "Invalid"


class HandleKeyRecord(_Model):
    name: str = Field(
        description="The Secret in the resource's namespace that holds its handle key, "
        "which every engine and router pod reads by this name. The operator created it "
        "and recorded it here before any child referred to it; it never reads it.")
    uid: str = Field(
        description="That Secret's uid as the API server answered the create: a Secret of "
        "this name with another uid is not the one the operator created.")


class DisaggregatedInferenceStatus(_Model):
    observed_generation: int | None = Field(default=None, description="Last generation seen.")
    phase: Phase | None = Field(default=None, description="Summary state.")
    prefill: RoleStatus | None = Field(default=None, description="Prefill pool.")
    decode: RoleStatus | None = Field(default=None, description="Decode replicas.")
    router_ready: int | None = Field(default=None, description="Ready router pods.")
    router_url: str | None = Field(default=None, description="In-cluster URL of the router.")
    kv_fingerprint: str | None = Field(
        default=None, description="Hash of what prefill and decode must share."
    )
    handle_key: HandleKeyRecord | None = Field(
        default=None, description="The handle-key Secret the operator created.")
    conditions: list[Condition] = Field(default_factory=list, description="Conditions.")
