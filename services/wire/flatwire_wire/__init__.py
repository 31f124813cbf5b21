"""flatwire's wire layer: the one owner of protobuf and of the logprob layout.

- pb/: the code generated from protos/ (scripts/gen_protos.py), imported nowhere else;
- codec.py: typed twins of the messages and the converter between the two;
- logprobs.py: the logprob rows in their three forms (device or host rows, the wire block, a request's);
- steps.py: what a scheduler step ships (StepMessage) and the position rule every hop applies;
- scheduler.py, detokenizer.py, public.py: each service's twins and typed client; control.py: what the
  public and internal APIs share (rollout control);
- rpc.py: serving and calling a service in twins.

The services and the client package (flatwire_client) use only this package's types; it needs protobuf, grpcio
and numpy, nothing of the servers.
"""
