"""A failed step's re-run sends each request whole again (the workers dropped it)."""

from types import SimpleNamespace

from bladellm.core.interface import SchedulerOutput
from bladellm.engine.step_isolation import sub_step
from bladellm.multimodal.inputs import MultiModalItem
from bladellm.request import Request
from bladellm.sampling_params import SamplingParams


def test_sub_step_resends_images_and_adapter():
    image = MultiModalItem(modality="image", hash="h", offset=1, length=2, tensors={})
    req = Request("r", [5, 9, 9, 6], SamplingParams(max_tokens=4), mm_items=[image])
    req.lora_id = 3
    sched = SchedulerOutput()
    sched.num_scheduled_tokens["r"] = 4
    scheduler = SimpleNamespace(requests={"r": req},
                                kv_cache_manager=SimpleNamespace(
                                    get_group_block_ids=lambda _: [[7]]))
    new = sub_step(sched, ["r"], scheduler).scheduled_new_reqs[0]
    assert new.mm_items == [image]  # else the placeholders would run as plain text
    assert (new.token_ids, new.block_ids, new.lora_id) == ([5, 9, 9, 6], [7], 3)
