"""How far one backward pass is with one unit: what still reads its full weights.

[Note: partly frozen units] A unit's full weights are read in backward by every node
that computes a gradient through them: of its trainable parameters, and of its inputs.
When every parameter of a unit is trainable, the post-accumulate-grad hook of its last
parameter comes after all of them (each node that reads a weight also produces that
weight's gradient). A frozen weight breaks this: LoRA's base ``k_proj`` has no
gradient of its own, yet its input gradient is computed from it, possibly after the
adapters' last gradient has arrived — releasing the unit then leaves the node an
emptied storage ("setStorage ... out of bounds for storage of size 0"). So a unit with
frozen parameters also counts its forward calls whose inputs need a gradient, and each
such call's input gradients as they are computed (an identity autograd function on the
inputs, FSDP2's ``RegisterPostBackwardFunction`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``); its weights are released when
both are complete. A call whose inputs need no gradient (the first block under frozen
embeddings) reads no weight in backward but for its trainable parameters' gradients.
A unit whose module calls other units (the root: final norm, head and embeddings around
the blocks) is read on the way to their gradients, not its inputs': with frozen
parameters it is held until backward ends (peft's ``modules_to_save`` head trains there
beside a frozen norm).
"""

from __future__ import annotations


class BackwardProgress:
    """Counts of one unit in the current backward (its fields change only here)."""

    def __init__(self, trainable: int) -> None:
        self.trainable = trainable
        self.grads = 0
        """Trainable parameters yet to accumulate their gradient in this backward."""
        self.calls = 0
        """Forward calls since the last backward whose inputs need a gradient."""
        self.inputs_done = 0
        """Of those calls, the ones whose input gradients this backward has computed."""
        self._counted = False  # a backward began since ``calls`` was counted
        self.to_the_end = False
        """Released only when backward ends (a unit with frozen parameters whose module
        calls other units)."""

    def hold_to_the_end(self) -> None:
        self.to_the_end = True

    def forward_call(self) -> None:
        """A forward call whose inputs need a gradient (counted afresh after a
        backward: the next backward runs the graph of the forwards since)."""
        if self._counted:
            self.calls, self._counted = 0, False
        self.calls += 1

    def start(self) -> None:
        """A backward begins (again over the same graph, under ``retain_graph``)."""
        self.grads, self.inputs_done, self._counted = self.trainable, 0, True

    def grad_arrived(self) -> bool:
        """A trainable parameter has its gradient; True when it was the last."""
        self.grads -= 1
        return self.grads == 0

    def input_done(self) -> None:
        self.inputs_done += 1

    @property
    def finished(self) -> bool:
        """Nothing of this backward reads the unit's full weights any more."""
        return not self.to_the_end and self.grads <= 0 and self.inputs_done >= self.calls
