import sys, json, shutil, os
sys.path.insert(0, "/tmp/snap"); sys.path.insert(0, "/tmp/snap/tests")
import torchrl_dcp as tdcp
from tests import forging
from torchrl_dcp.format.manifest import FORMAT_VERSION
for v in (1, 3, 6):
    for w in (1, 2):
        src = f"/tmp/probe_f/ck/v{v}_w{w}"; dst = f"/tmp/probe_f/fg/newer_v{v}_w{w}"
        shutil.rmtree(dst, ignore_errors=True); shutil.copytree(src, dst)
        m = json.loads(open(f"{dst}/manifest.json").read())
        m["format_version"] = FORMAT_VERSION + 1
        forging.write_parts(__import__("pathlib").Path(dst), m) if v >= 5 else open(f"{dst}/manifest.json", "w").write(json.dumps(tdcp.format.manifest.seal(m) if v >= 3 else m))
        for fn in (lambda: tdcp.read_manifest(dst), lambda: tdcp.verify(dst), lambda: tdcp.DistributedCheckpoint(x={}).load(dst), lambda: tdcp.to_archive(dst, dst + ".zip")):
            try:
                fn(); print(v, w, "NO ERROR")
            except tdcp.CheckpointVersionError as e:
                print(v, w, "VersionError:", str(e)[:250])
            except Exception as e:
                print(v, w, "OTHER", type(e).__name__, str(e)[:250])
