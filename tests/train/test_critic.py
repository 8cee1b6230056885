"""The critic's position convention on a hand-made example: the value of response token t is read at the row
whose logits produced token t (the input row of token t-1), exactly like the logprob of token t."""

import torch

from exactrl.model import build_model, preset
from exactrl.train.critic import ValueModel
from exactrl.train.packing import PackedBatch


def _critic():
    policy = build_model(preset("tiny", num_layers=2), seed=3)
    critic = ValueModel.from_policy(policy)
    with torch.no_grad():
        critic.value_head.normal_(0, 1.0)
    return critic


def test_value_of_token_t_is_read_before_token_t():
    critic = _critic()
    prompt, completion = [5, 6, 7], [8, 9]
    pb = PackedBatch.build([prompt + completion], [len(prompt)])
    with torch.no_grad():
        v = critic(pb)[pb.response_mask]
    assert v.shape == (2,)
    # Rows: inputs are [5,6,7,8]; targets [6,7,8,9]; completion targets 8 and 9 sit at input rows 2 and 3.
    assert pb.response_mask.tolist() == [False, False, True, True]
    # Changing the first completion token leaves its own value alone (it is read before the token is seen)...
    pb2 = PackedBatch.build([prompt + [42, 9]], [len(prompt)])
    with torch.no_grad():
        v2 = critic(pb2)[pb2.response_mask]
    assert torch.equal(v2[0], v[0])
    # ...but changes the value of the next one, whose context now includes it.
    assert not torch.equal(v2[1], v[1])
    # And the value of completion token 0 is the prompt's last row: the same as scoring the prompt alone.
    pb3 = PackedBatch.build([prompt + [8]], [len(prompt)])
    with torch.no_grad():
        assert torch.equal(critic(pb3)[pb3.response_mask][0], v[0])


def test_critic_is_independent_of_the_policy():
    policy = build_model(preset("tiny", num_layers=2), seed=3)
    critic = ValueModel.from_policy(policy)
    with torch.no_grad():
        critic.backbone.model.norm.weight.add_(1.0)
    assert not torch.equal(critic.backbone.model.norm.weight, policy.model.norm.weight)
