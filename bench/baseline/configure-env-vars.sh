#!/bin/bash
# Baseline for bench/run.py: the documented cloud-init script (configure-env-vars.sh) that
# writes tpu-env, line for line, except that the metadata server is the bench guest's emulator
# (127.0.0.1:8080, as $GCE_METADATA_HOST points tpuboot) instead of the GCE one.

grep -q CLOUDSDK_PYTHON /etc/environment || echo "CLOUDSDK_PYTHON=/usr/bin/python3" >> /etc/environment

export HOME=/home/tpu-runtime
curl -s "http://${GCE_METADATA_HOST:-127.0.0.1:8080}/computeMetadata/v1/instance/attributes/tpu-env" -H 'Metadata-Flavor: Google' > /tmp/tpu-env.yaml

eval $(python3 -c '''
import yaml
stream_in=open("/tmp/tpu-env.yaml", "r")
for k,v in yaml.safe_load(stream_in).items():
  print("{var}=\"{value}\"".format(var = k, value = str(v)))
''' > "/${HOME}/tpu-env"
)

rm -f "/tmp/tpu-env.yaml"

printenv
cat ${HOME}/tpu-env
