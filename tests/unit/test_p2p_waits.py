"""How the pipeline transport waits for a message, per device (no process group needed)."""


def test_pipeline_waits_are_timed_on_cpu_and_stream_waits_on_cuda():
    """A timed ``Work.wait`` blocks the host until the transfer ends; on CUDA the wait stays untimed (a stream
    wait), bounded by the process group's timeout instead. Building the transport touches no device."""
    from ppctl.pipeline.p2p import PipelineTransport

    def transport(device):
        return PipelineTransport(lambda pp_rank: pp_rank, lambda message: None, device, timeout_s=5.0)

    assert transport("cpu").timeout_s == 5.0
    assert transport("cuda:1").timeout_s is None and transport("cuda").timeout_s is None
