# Sourced by bench/gpu_smoke.sh and bench/gpu_session.sh: install what the GPU machine lacks
# and check that the start-up hook is live. With .whl (wheels for a machine without the
# package index; fill it here with `bash ../shared/gpu/fetch_wheels.sh`) it installs from
# there, else from the index (`pip install -e ".[test,gds]"` next to the CUDA torch there).
site=/tmp/site
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || exit 1
    export PYTHONPATH=$PWD:$site
    # The .pth start-up hook must sit in a directory Python scans for .pth files at start-up
    # (PYTHONPATH entries are not): the user site, else the interpreter's own site-packages.
    pth_dir=$(python3 -c 'import site; print(site.getusersitepackages() if site.ENABLE_USER_SITE else "")')
    if [ -z "$pth_dir" ] || ! { mkdir -p "$pth_dir" && cp protrain-autoload.pth "$pth_dir/"; }; then
        pth_dir=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        cp protrain-autoload.pth "$pth_dir/" || { echo "cannot install the start-up hook"; exit 1; }
    fi
else
    echo "no .whl/: installing from the package index"
    python3 -m pip install -q -e ".[test]" || exit 1
    python3 -m pip install -q -e ".[gds]" || echo "kvikio not installed: the SSD tier uses its POSIX backend"
fi
# DeepSpeed 0.19.8's JIT builder parses TORCH_CUDA_ARCH_LIST as numbers: an architecture with
# the 'a' suffix (9.0a, which this GPU image sets) fails every CUDA op build (FusedAdam: plain
# DeepSpeed's optimizer) with "invalid literal for int() with base 10: '0a'" (first GPU run).
echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-unset}"
case "${TORCH_CUDA_ARCH_LIST:-}" in
  *[0-9]a*) fixed=$(echo "$TORCH_CUDA_ARCH_LIST" | sed 's/\([0-9]\)a/\1/g')
            echo "TORCH_CUDA_ARCH_LIST='$TORCH_CUDA_ARCH_LIST' -> '$fixed' (DeepSpeed cannot parse the 'a' suffix)"
            export TORCH_CUDA_ARCH_LIST=$fixed ;;
esac
python3 - <<'PY' || exit 1
import deepspeed, torch
assert getattr(deepspeed.initialize, "_protrain_wrapper", False), "start-up hook not active"
print(f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}, "
      f"torch {torch.__version__}, deepspeed {deepspeed.__version__}; protrain start-up hook active")
PY
