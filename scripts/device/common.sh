# What every scripts/device_*.sh call does first; sourced once the caller has set bin (the carried
# binaries), out (where logs and JSON go) and steps (the comma-separated steps to run).
# Binaries are carried compressed to fit the 64 MiB carry (each gzipped, or all in one bins.tar.xz);
# they are unpacked to /tmp/<script>_bin and bin then points there. Defines log ($out/device.log,
# which starts with the GPU's clocks, temperature and driver), status (0 until a step fails) and
# step NAME (whether NAME is among $steps).
mkdir -p "$out"
unpacked=/tmp/$(basename "$0" .sh)_bin
if compgen -G "$bin/*.gz" > /dev/null || [[ -f $bin/bins.tar.xz ]]; then
  mkdir -p "$unpacked"
  for f in "$bin"/*.gz; do [[ -f $f ]] && gzip -dc "$f" > "$unpacked/$(basename "$f" .gz)"; done
  # python3, not tar -J: the device machine is not promised an xz binary.
  [[ -f $bin/bins.tar.xz ]] &&
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$bin/bins.tar.xz" "$unpacked"
  chmod +x "$unpacked"/*
  bin=$unpacked
fi
status=0
step() { [[ ",$steps," == *",$1,"* ]]; }
log=$out/device.log
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,driver_version --format=csv |
  tee -a "$log"
