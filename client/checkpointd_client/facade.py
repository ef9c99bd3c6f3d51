"""PolicySaverFacade: PolicySaver's surface, as AsyncPolicySaver offers it.

RemotePolicySaver keeps a real `PolicySaver` to export its templates. This
base class hands that saver's properties and function registrations through,
as AsyncPolicySaver does, so the saving class holds only what differs: the
daemon, the save path (`PolicySaves`) and the tickets. A registration tells
the save path, so the template is exported again before the next save.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from tf_agents.policies import policy_saver
from tf_agents.typing import types

from checkpointd_client.policy_saves import PolicySaves


class PolicySaverFacade:
    """The pass-through half of RemotePolicySaver.

    Subclasses set `_saver` (the PolicySaver), `_run`, `_folder`, `_address`
    and `_saves` (the save path) in their constructor.
    """

    _saver: policy_saver.PolicySaver
    _run: str
    _folder: str | None
    _address: str
    _saves: PolicySaves

    @property
    def run(self) -> str:
        return self._run

    @property
    def folder(self) -> str:
        """The run's folder under the daemon's root."""
        return self._folder or self._run

    @property
    def address(self) -> str:
        return self._address

    @property
    def policy(self) -> tf.Module:
        """The module PolicySaver exports (not the TFPolicy given)."""
        return self._saver.policy

    @property
    def action_input_spec(self) -> types.NestedTensorSpec:
        return self._saver.action_input_spec

    @property
    def policy_step_spec(self) -> types.NestedTensorSpec:
        return self._saver.policy_step_spec

    @property
    def policy_state_spec(self) -> types.NestedTensorSpec:
        return self._saver.policy_state_spec

    @property
    def signatures(self) -> dict[str, Callable[..., Any]]:
        return self._saver.signatures

    def get_train_step(self) -> types.Int:
        return self._saver.get_train_step()

    def get_metadata(self) -> dict[str, tf.Variable]:
        return self._saver.get_metadata()

    def register_function(
        self,
        name: str,
        fn: policy_saver.InputFnType,
        input_spec: types.NestedTensorSpec,
        outer_dims: Sequence[int | None] = (None,),
    ) -> None:
        """As PolicySaver's; the template is exported again before the next save."""
        self._saver.register_function(name, fn, input_spec, outer_dims)
        self._saves.template_changed()

    def register_concrete_function(self, name: str, fn: Any, assets: Any | None = None) -> None:
        """As PolicySaver's; the template is exported again before the next save."""
        self._saver.register_concrete_function(name, fn, assets)
        self._saves.template_changed()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks; forward them like AsyncPolicySaver.
        if name.startswith("__") or "_saver" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._saver, name)
