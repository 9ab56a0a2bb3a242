"""``k3fusion.install()`` / ``uninstall()`` with a user's own ``post_grad_custom_post_pass``:
theirs keeps running, and uninstall takes out only k3fusion's pass (issue 16 item 6)."""

from __future__ import annotations

import pytest
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import k3fusion
from graph_utils import fresh_state
from k3fusion.pass_manager import ComposedPass, K3FusionPass

_FIXTURES = (fresh_state,)  # used by name
pytestmark = pytest.mark.usefixtures("fresh_state")


class UserPass(CustomGraphPass):
    def __init__(self, tag):
        self.tag = tag

    def __call__(self, graph):
        pass

    def uuid(self):
        return self.tag


def _current():
    return inductor_config.post_grad_custom_post_pass


def test_a_pass_set_after_install_survives_uninstall():
    """The issue's repro: install, the user sets theirs, uninstall left None."""
    inductor_config.post_grad_custom_post_pass = None
    k3fusion.install()
    theirs = UserPass("late")
    inductor_config.post_grad_custom_post_pass = theirs
    k3fusion.uninstall()
    assert _current() is theirs


@pytest.mark.parametrize("before", ["none", "pass", "list"])
def test_uninstall_restores_exactly_what_was_there(before):
    previous = {"none": None, "pass": UserPass("a"), "list": [UserPass("a")]}[before]
    inductor_config.post_grad_custom_post_pass = previous
    k3fusion.install()
    k3fusion.install()  # idempotent
    assert _current() is not previous
    k3fusion.uninstall()
    assert _current() is previous
    k3fusion.uninstall()  # no-op
    assert _current() is previous


def test_user_additions_to_the_installed_list_are_kept():
    first, late = UserPass("a"), UserPass("b")
    inductor_config.post_grad_custom_post_pass = [first]
    k3fusion.install()
    installed = _current()
    assert installed[0] is first and isinstance(installed[1], K3FusionPass)
    installed.append(late)  # in place
    k3fusion.uninstall()
    assert _current() == [first, late]


def test_the_installed_pass_inside_a_user_list_is_replaced_by_what_was_there():
    first, late = UserPass("a"), UserPass("b")
    inductor_config.post_grad_custom_post_pass = first
    k3fusion.install()
    installed = _current()
    assert isinstance(installed, ComposedPass) and installed.passes[0] is first
    inductor_config.post_grad_custom_post_pass = [installed, late]  # theirs and ours run
    k3fusion.uninstall()
    assert _current() == [first, late]
