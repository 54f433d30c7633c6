#!/usr/bin/env python3
"""A CSI client, as the kubelet is one: calls batchfs-csi's Identity and Node RPCs over its unix socket.

    csi_client.py SOCKET

Compiles csi/proto/csi.proto (the declarations the plugin is built from) with grpcio-tools, then reads
one JSON object a line on stdin, {"rpc": "NodePublishVolume", "request": {...}} (the request as protobuf's
JSON mapping: camelCase or the proto's names), calls that RPC, and writes one JSON line on stdout:
{"code": "OK" or the gRPC status code's name, "details": the status message, "response": {...}}.
Nothing here uses the plugin's own Rust types.
"""
import json
import os
import sys
import tempfile

import grpc
from google.protobuf import json_format
from grpc_tools import protoc

PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "csi", "proto")

SERVICES = {
    "GetPluginInfo": "Identity",
    "GetPluginCapabilities": "Identity",
    "Probe": "Identity",
    "NodePublishVolume": "Node",
    "NodeUnpublishVolume": "Node",
    "NodeGetCapabilities": "Node",
    "NodeGetInfo": "Node",
    # Declared by the spec, not served by this plugin (it has no STAGE_UNSTAGE_VOLUME capability).
    "NodeStageVolume": "Node",
}


def compile_proto(out):
    import grpc_tools

    wkt = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"-I{wkt}", f"--python_out={out}", f"--grpc_python_out={out}",
                      os.path.join(PROTO_DIR, "csi.proto")])
    if rc != 0:
        sys.exit(f"protoc failed on csi.proto ({rc})")
    sys.path.insert(0, out)


def main():
    socket = sys.argv[1]
    with tempfile.TemporaryDirectory() as out:
        compile_proto(out)
        import csi_pb2

        # The kubelet (grpc-go) sends "localhost" as the :authority of a unix socket's requests; grpcio since
        # 1.57 sends the socket's path, which HTTP/2 servers that check it (the plugin's among them) refuse.
        channel = grpc.insecure_channel(f"unix://{socket}", options=[("grpc.default_authority", "localhost")])
        for line in sys.stdin:
            call = json.loads(line)
            rpc = call["rpc"]
            service = SERVICES[rpc]
            if rpc == "NodeStageVolume":
                # Not in the plugin's proto: sent as raw bytes (an empty request) to see the plugin answer.
                request_type, response_type = None, None
            else:
                request_type = getattr(csi_pb2, rpc + "Request")
                response_type = getattr(csi_pb2, rpc + "Response")
            method = channel.unary_unary(
                f"/csi.v1.{service}/{rpc}",
                request_serializer=(lambda m: m.SerializeToString()) if request_type else (lambda m: b""),
                response_deserializer=response_type.FromString if response_type else (lambda b: b),
            )
            request = json_format.ParseDict(call.get("request", {}), request_type()) if request_type else None
            try:
                response = method(request, timeout=call.get("timeout", 120))
                answer = {"code": "OK", "details": "",
                          "response": json_format.MessageToDict(response, preserving_proto_field_name=True)
                          if response_type else {}}
            except grpc.RpcError as e:
                answer = {"code": e.code().name, "details": e.details(), "response": None}
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
