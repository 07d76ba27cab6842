{{/*
The alert rules, as a Prometheus rules file's `groups`. Rendered into the PrometheusRule;
tests render them into a plain rules file for `promtool check rules` and `promtool test rules`
(charts/kubetrain/tests/alerts_test.yaml). Every alert about a job carries `namespace` and `trainingjob`
(the TrainingJob's name; `job` is Prometheus's scrape job), so that Alertmanager routes it to its team.
*/}}
{{- define "kubetrain.alertGroups" -}}
- name: kubetrain.rules
  rules:
  - alert: KubetrainOperatorDown
    expr: absent(kubetrain_operator_jobs)
    for: 5m
    labels:
      severity: critical
    annotations:
      summary: The kubetrain operator is not being scraped
      description: No kubetrain_operator_* metrics for 5 minutes; TrainingJobs are not reconciled (no gang restarts, no TTL cleanup).
  - alert: KubetrainJobFailed
    expr: sum by (namespace, trainingjob, reason) (increase(kubetrain_operator_jobs_finished_total{phase="Failed"}[10m])) > 0
    labels:
      severity: warning
    annotations:
      summary: TrainingJob {{ "{{" }} $labels.namespace {{ "}}" }}/{{ "{{" }} $labels.trainingjob {{ "}}" }} failed ({{ "{{" }} $labels.reason {{ "}}" }})
      description: 'TrainingJob {{ "{{" }} $labels.trainingjob {{ "}}" }} in namespace {{ "{{" }} $labels.namespace {{ "}}" }} finished Failed with reason {{ "{{" }} $labels.reason {{ "}}" }}; see `kubectl -n {{ "{{" }} $labels.namespace {{ "}}" }} describe tj {{ "{{" }} $labels.trainingjob {{ "}}" }}`.'
  - alert: KubetrainRestartStorm
    expr: sum by (namespace, trainingjob) (increase(kubetrain_operator_gang_restarts_total[30m])) >= {{ .Values.metrics.prometheusRule.restartStormThreshold }}
    labels:
      severity: warning
    annotations:
      summary: TrainingJob {{ "{{" }} $labels.namespace {{ "}}" }}/{{ "{{" }} $labels.trainingjob {{ "}}" }} restarts again and again
      description: '{{ "{{" }} $value | humanize {{ "}}" }} whole-gang restarts of TrainingJob {{ "{{" }} $labels.trainingjob {{ "}}" }} (namespace {{ "{{" }} $labels.namespace {{ "}}" }}) in 30 minutes: a bad node, a bad image or a crashing job; its status.failures counts them by reason.'
  - alert: KubetrainJobNoProgress
    expr: max by (namespace, trainingjob) (changes(kubetrain_trainer_step[{{ .Values.metrics.prometheusRule.noProgressFor }}])) == 0 and max by (namespace, trainingjob) (kubetrain_trainer_step) > 0
    for: 1m
    labels:
      severity: warning
    annotations:
      summary: TrainingJob {{ "{{" }} $labels.namespace {{ "}}" }}/{{ "{{" }} $labels.trainingjob {{ "}}" }} makes no progress
      description: The optimizer step of {{ "{{" }} $labels.trainingjob {{ "}}" }} (namespace {{ "{{" }} $labels.namespace {{ "}}" }}) has not moved for {{ .Values.metrics.prometheusRule.noProgressFor }} (hung collective, stalled data loader or stuck checkpoint).
{{- end -}}
