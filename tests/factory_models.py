"""User model factories for `autoplan apply --model factory_models:...` tests."""

import os
import signal

from autoplan.models.zoo import GPT2, get_config


def tiny_gpt2():
    return GPT2(get_config("gpt2-tiny"))  # on the ambient device: meta under load_factory(device="meta")


class DyingGPT2(GPT2):
    """gpt2-tiny whose rank 1 is killed (SIGKILL, as the kernel's OOM killer would) in its 2nd forward."""

    calls = 0

    def forward(self, input_ids):
        DyingGPT2.calls += 1
        if os.environ.get("RANK") == "1" and DyingGPT2.calls == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(input_ids)


def dying_gpt2():
    return DyingGPT2(get_config("gpt2-tiny"))
