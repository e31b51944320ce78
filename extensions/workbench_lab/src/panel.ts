/**
 * RunsPanel: the left side panel. It polls the server every `refreshInterval` seconds while
 * visible and updates each run's card in place (so focus and scroll survive a refresh):
 * name, state, target, step / total, latest loss, cost, ETA, a mini loss curve and the actions
 * the server says the library supports. A sweep's trials are grouped under one collapsible row
 * (sweep id, trials done / total, spend against the budget, best objective).
 */
import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { CourseSection } from './course';
import { ExportChooser } from './export';
import { duration, money, number, runMoney } from './format';
import { drawSparkline } from './sparkline';
import {
  ICapabilities,
  IEndpoint,
  IRun,
  IRunsReply,
  ISweep,
  IWallet,
  RunAction,
  TERMINAL_STATES,
  WorkbenchService
} from './service';

/** What the panel asks its host (the plugin) to do: open things in the rest of JupyterLab. */
export interface IRunsPanelHost {
  openDetails(run: IRun): void;
  openFolder(path: string): void;
  newRun(): void;
  compare(runIds: string[]): void;
}

function button(label: string, aria: string, onClick: () => void): HTMLButtonElement {
  const b = document.createElement('button');
  b.type = 'button';
  b.className = 'jp-WorkbenchRuns-button';
  b.textContent = label;
  b.setAttribute('aria-label', aria);
  b.title = aria;
  b.addEventListener('click', onClick);
  return b;
}

class RunCard {
  readonly node = document.createElement('li');
  private readonly nameNode = document.createElement('span');
  private readonly stateNode = document.createElement('span');
  private readonly metaNode = document.createElement('div');
  private readonly distinctNode = document.createElement('div');
  private readonly errorNode = document.createElement('div');
  private readonly spark = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
  private readonly actions = document.createElement('div');
  private readonly pick = document.createElement('input');
  private actionsKey = '';
  run: IRun;

  constructor(
    run: IRun,
    private readonly panel: RunsPanel
  ) {
    this.run = run;
    this.node.className = 'jp-WorkbenchRuns-run';
    this.node.dataset.runId = run.id;
    this.node.setAttribute('aria-label', `run ${run.name}`);
    const head = document.createElement('div');
    head.className = 'jp-WorkbenchRuns-head';
    this.nameNode.className = 'jp-WorkbenchRuns-name';
    this.stateNode.className = 'jp-WorkbenchRuns-state';
    // Ticked runs are what the panel's Compare button opens side by side.
    this.pick.type = 'checkbox';
    this.pick.className = 'jp-WorkbenchRuns-pick';
    this.pick.setAttribute('aria-label', `select ${run.name} to compare`);
    this.pick.addEventListener('change', () => panel.select(this.run.id, this.pick.checked));
    head.append(this.pick, this.nameNode, this.stateNode);
    this.metaNode.className = 'jp-WorkbenchRuns-meta';
    this.distinctNode.className = 'jp-WorkbenchRuns-distinct';
    this.errorNode.className = 'jp-WorkbenchRuns-error';
    this.spark.classList.add('jp-WorkbenchSpark');
    this.spark.setAttribute('role', 'img');
    this.actions.className = 'jp-WorkbenchRuns-actions';
    this.node.append(head, this.distinctNode, this.metaNode, this.spark, this.errorNode, this.actions);
    this.update(run, panel.capabilities);
  }

  update(run: IRun, caps: ICapabilities): void {
    this.run = run;
    const state = run.state || 'pending';
    this.nameNode.textContent = run.name;
    this.nameNode.title = run.id;
    this.stateNode.textContent = state;
    this.stateNode.className = `jp-WorkbenchRuns-state jp-mod-${state}`;
    this.stateNode.title = run.queue_reason ? `waiting: ${run.queue_reason}` : '';
    this.node.dataset.state = state;
    const parts = [
      run.target,
      `step ${run.step ?? 0} / ${run.total_steps ?? '?'}`,
      `loss ${number(run.last_loss)}`
    ];
    if (run.queue_reason) {
      parts.splice(1, 0, `waiting: ${run.queue_reason}`); // the scheduler's word for why
    }
    const cost = runMoney(run);
    if (cost) {
      parts.push(cost);
    }
    if (!TERMINAL_STATES.has(state)) {
      parts.push(`ETA ${duration(run.eta_s)}`);
    } else {
      parts.push(`took ${duration(run.elapsed_s)}`);
    }
    this.metaNode.textContent = parts.join(' · ');
    // What tells this run from others of its name, and its score; the full id on hover.
    const distinct = [run.differs, run.score].filter(Boolean).join(' · ');
    this.distinctNode.textContent = distinct;
    this.distinctNode.title = run.id;
    this.distinctNode.hidden = !distinct;
    const problem = run.error || run.note;
    this.errorNode.textContent = problem ? String(problem).split('\n')[0] : '';
    this.errorNode.classList.toggle('jp-mod-note', !run.error && !!run.note);
    this.errorNode.hidden = !problem;
    drawSparkline(this.spark, run.curve);
    this.spark.setAttribute('aria-label', `loss curve of ${run.name}, ${run.curve.length} points`);
    this.renderActions(run, caps);
  }

  private renderActions(run: IRun, caps: ICapabilities): void {
    const state = run.state || 'pending';
    const done = TERMINAL_STATES.has(state);
    const wanted: [string, string, () => void][] = [
      ['Details', `details of ${run.name}`, () => this.panel.host.openDetails(this.run)]
    ];
    if (caps.cancel && !done) {
      wanted.push(['Cancel', `cancel ${run.name}`, () => void this.panel.act(this.run, 'cancel')]);
    }
    if (caps.resume && done && state !== 'succeeded') {
      // After a budget stop the same limit would stop it again at once: ask for a larger one.
      const resume =
        state === 'budget_stopped'
          ? () => void this.panel.resumeWithBudget(this.run)
          : () => void this.panel.act(this.run, 'resume');
      wanted.push(['Resume', `resume ${run.name}`, resume]);
    }
    if (caps.deploy && state === 'succeeded') {
      wanted.push(['Deploy', `deploy ${run.name}`, () => void this.panel.deploy(this.run)]);
    }
    if (caps.export && state === 'succeeded') {
      wanted.push(['Export', `export ${run.name}`, () => void this.panel.exportRun(this.run)]);
    }
    if (run.browse_path !== null) {
      wanted.push(['Folder', `open the run folder of ${run.name} in the file browser`, () =>
        this.panel.host.openFolder(this.run.browse_path!)]);
    }
    if (caps.tensorboard && run.has_tensorboard) {
      wanted.push(['TensorBoard', `open TensorBoard for ${run.name}`, () =>
        void this.panel.act(this.run, 'tensorboard')]);
    }
    const key = wanted.map(w => w[0]).join('|');
    if (key === this.actionsKey) {
      return; // same buttons: keep them (and the keyboard focus on them)
    }
    this.actionsKey = key;
    this.actions.replaceChildren(...wanted.map(([label, aria, fn]) => button(label, aria, fn)));
  }
}

/** Put ``nodes`` as the children of ``parent`` in this order, moving only what is out of place
 * (so focus and scroll survive a refresh), and drop any other child. */
function placeChildren(parent: HTMLElement, nodes: HTMLElement[]): void {
  nodes.forEach((node, index) => {
    if (parent.children[index] !== node) {
      parent.insertBefore(node, parent.children[index] ?? null);
    }
  });
  while (parent.children.length > nodes.length) {
    parent.lastElementChild!.remove();
  }
}

/** One sweep: a header row (collapsible) with its trials' cards under it. */
class SweepGroup {
  readonly node = document.createElement('li');
  readonly trials = document.createElement('ul');
  private readonly toggle = document.createElement('button');
  private readonly nameNode = document.createElement('span');
  private readonly stateNode = document.createElement('span');
  private readonly metaNode = document.createElement('div');
  private readonly errorNode = document.createElement('div');
  /** Set once the user opened or closed it; until then a running sweep is open. */
  private expanded: boolean | null = null;
  sweep: ISweep;

  constructor(sweep: ISweep) {
    this.sweep = sweep;
    this.node.className = 'jp-WorkbenchRuns-sweep';
    this.node.dataset.sweepId = sweep.id;
    const head = document.createElement('div');
    head.className = 'jp-WorkbenchRuns-head';
    this.toggle.type = 'button';
    this.toggle.className = 'jp-WorkbenchRuns-toggle';
    this.toggle.addEventListener('click', () => {
      this.expanded = !this.isOpen();
      this.update(this.sweep);
    });
    this.nameNode.className = 'jp-WorkbenchRuns-name';
    this.stateNode.className = 'jp-WorkbenchRuns-state';
    head.append(this.toggle, this.nameNode, this.stateNode);
    this.metaNode.className = 'jp-WorkbenchRuns-meta';
    this.errorNode.className = 'jp-WorkbenchRuns-error';
    this.trials.className = 'jp-WorkbenchRuns-list jp-WorkbenchRuns-trials';
    this.trials.setAttribute('aria-label', `trials of ${sweep.id}`);
    this.node.append(head, this.metaNode, this.errorNode, this.trials);
    this.update(sweep);
  }

  private isOpen(): boolean {
    return this.expanded ?? this.sweep.state === 'running';
  }

  update(sweep: ISweep): void {
    this.sweep = sweep;
    const state = sweep.state || 'running';
    const open = this.isOpen();
    this.toggle.textContent = open ? '▾' : '▸';
    this.toggle.setAttribute('aria-expanded', String(open));
    this.toggle.setAttribute('aria-label', `${open ? 'collapse' : 'expand'} sweep ${sweep.id}`);
    this.trials.hidden = !open;
    this.nameNode.textContent = `sweep ${sweep.id}`;
    this.nameNode.title = sweep.id;
    this.stateNode.textContent = state;
    this.stateNode.className = `jp-WorkbenchRuns-state jp-mod-${state}`;
    this.node.dataset.state = state;
    const parts = [`trials ${sweep.trials_done} / ${sweep.trials_total ?? '?'}`];
    // Spent (ended trials' bills) and held (the limits of trials under way) apart: a sweep that
    // has just started holds much and has spent nothing.
    const c = sweep.currency || '';
    const spent = `spent ${money(sweep.spent, c) || `0 ${c}`.trim()}`;
    const held = sweep.held ? ` · held ${money(sweep.held, c)}` : '';
    parts.push(`${spent}${held}` + (sweep.budget !== null ? ` of ${sweep.budget} ${c}`.trimEnd() : ''));
    if (sweep.best) {
      parts.push(
        `best ${sweep.objective ?? 'objective'} ${number(sweep.best.value)} (trial ${sweep.best.trial})`
      );
    }
    this.metaNode.textContent = parts.join(' · ');
    this.errorNode.textContent = sweep.error ? String(sweep.error).split('\n')[0] : '';
    this.errorNode.hidden = !sweep.error;
  }
}

/** The Deploy dialog's body: where to serve, preselected on the target the run trained on. */
class TargetChooser extends Widget implements Dialog.IBodyWidget<string> {
  private readonly select = document.createElement('select');

  constructor(targets: string[], current: string) {
    super();
    this.addClass('jp-WorkbenchDeploy');
    const label = document.createElement('label');
    label.textContent = 'Serve on ';
    this.select.setAttribute('aria-label', 'deploy target');
    const names = targets.includes(current) ? targets : [...targets, current];
    for (const name of names) {
      const option = document.createElement('option');
      option.value = option.textContent = name;
      option.selected = name === current;
      this.select.append(option);
    }
    label.append(this.select);
    const hint = document.createElement('p');
    hint.textContent =
      'vLLM serves the run there (an OpenAI-compatible API); it appears under Endpoints.';
    this.node.append(label, hint);
  }

  getValue(): string {
    return this.select.value;
  }
}

/** The Resume dialog's body after a budget stop: the new limit, above what the run has spent. */
class BudgetChooser extends Widget implements Dialog.IBodyWidget<string> {
  private readonly input = document.createElement('input');

  constructor(run: IRun) {
    super();
    this.addClass('jp-WorkbenchBudget');
    const spent = run.cost ?? 0;
    const label = document.createElement('label');
    label.textContent = `New budget limit (${run.currency || 'CNY'}) `;
    this.input.type = 'number';
    this.input.min = String(spent);
    this.input.step = 'any';
    this.input.setAttribute('aria-label', 'new budget limit');
    label.append(this.input);
    const hint = document.createElement('p');
    hint.textContent = `Spent so far: ${spent.toFixed(2)}. The run goes on from its last snapshot.`;
    this.node.append(label, hint);
  }

  getValue(): string {
    return this.input.value;
  }
}

export class RunsPanel extends Widget {
  capabilities: ICapabilities = {
    cancel: true,
    resume: false,
    snapshots: false,
    deploy: false,
    endpoints: false,
    stop_endpoint: false,
    tensorboard: false,
    export: false
  };
  private readonly cards = new Map<string, RunCard>();
  private readonly groups = new Map<string, SweepGroup>();
  private readonly list = document.createElement('ul');
  private readonly endpointsList = document.createElement('ul');
  private readonly endpointsSection = document.createElement('section');
  private readonly statusNode = document.createElement('div');
  private readonly walletNode = document.createElement('details');
  private readonly course: CourseSection;
  private timer: number | null = null;
  private intervalMs = 2000;
  private inFlight = false;
  private endpointsKey = '';
  private targets: string[] = ['local'];
  private readonly selected = new Set<string>();
  private readonly compareButton = button(
    'Compare',
    'open the selected runs side by side',
    () => this.host.compare([...this.selected])
  );

  constructor(
    private readonly service: WorkbenchService,
    readonly host: IRunsPanelHost
  ) {
    super();
    this.course = new CourseSection(service);
    this.id = 'workbench-runs';
    this.addClass('jp-WorkbenchRuns');
    this.title.caption = 'Workbench runs';
    const header = document.createElement('header');
    header.className = 'jp-WorkbenchRuns-header';
    const h = document.createElement('h2');
    h.textContent = 'Workbench runs';
    header.append(
      h,
      button('New run', 'new fine-tuning run notebook', () => this.host.newRun()),
      this.compareButton,
      button('Refresh', 'refresh the runs now', () => void this.refresh())
    );
    this.list.className = 'jp-WorkbenchRuns-list';
    this.list.setAttribute('aria-label', 'runs');
    this.statusNode.className = 'jp-WorkbenchRuns-status';
    this.statusNode.setAttribute('role', 'status');
    const eh = document.createElement('h3');
    eh.textContent = 'Endpoints';
    this.endpointsList.className = 'jp-WorkbenchRuns-list';
    this.endpointsSection.append(eh, this.endpointsList);
    this.endpointsSection.hidden = true;
    this.walletNode.className = 'jp-WorkbenchRuns-wallet';
    this.walletNode.hidden = true;
    this.node.append(
      header,
      this.walletNode,
      this.course.node,
      this.statusNode,
      this.list,
      this.endpointsSection
    );
    this.select('', false);
  }

  /** Tick or untick a run for comparison; Compare needs two. */
  select(runId: string, on: boolean): void {
    if (runId) {
      if (on) {
        this.selected.add(runId);
      } else {
        this.selected.delete(runId);
      }
    }
    this.compareButton.disabled = this.selected.size < 2;
    this.compareButton.textContent = `Compare (${this.selected.size})`;
  }

  /** Seconds between refreshes (from the Settings Editor). */
  set refreshInterval(seconds: number) {
    this.intervalMs = Math.max(500, seconds * 1000);
    if (this.timer !== null) {
      this.startPolling();
    }
  }

  async refresh(): Promise<void> {
    if (this.inFlight) {
      return;
    }
    this.inFlight = true;
    try {
      const [reply] = await Promise.all([this.service.listRuns(), this.course.refresh()]);
      this.targets = reply.targets?.length ? reply.targets : ['local'];
      this.render(reply);
      this.statusNode.textContent = '';
    } catch (error) {
      this.statusNode.textContent = `Cannot read the runs: ${(error as Error).message}`;
    } finally {
      this.inFlight = false;
    }
  }

  /** Ask where to serve (the run's own target first), then deploy there. */
  async deploy(run: IRun): Promise<void> {
    const result = await showDialog({
      title: `Deploy ${run.name}`,
      body: new TargetChooser(this.targets, run.target || 'local'),
      buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Deploy' })]
    });
    if (result.button.accept && result.value) {
      await this.act(run, 'deploy', { target: result.value });
    }
  }

  /** Ask what to take home, start the export, and open Details, which shows its progress. */
  async exportRun(run: IRun): Promise<void> {
    const result = await showDialog({
      title: `Export ${run.name}`,
      body: new ExportChooser(),
      buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Export' })]
    });
    if (result.button.accept && result.value && result.value.formats.length) {
      await this.act(run, 'export', { ...result.value });
      this.host.openDetails(run);
    }
  }

  /** Ask for a larger budget, then resume the run with it. */
  async resumeWithBudget(run: IRun): Promise<void> {
    const result = await showDialog({
      title: `Resume ${run.name} with a larger budget`,
      body: new BudgetChooser(run),
      buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Resume' })]
    });
    if (result.button.accept && result.value) {
      await this.act(run, 'resume', { budget_limit: Number(result.value) });
    }
  }

  async act(run: IRun, action: RunAction, options?: Record<string, unknown>): Promise<void> {
    this.statusNode.textContent = `${action} ${run.name}…`;
    try {
      const reply = await this.service.act(run.id, action, options);
      if (action === 'tensorboard' && typeof reply.url === 'string') {
        window.open(reply.url, '_blank', 'noopener');
      }
      this.statusNode.textContent = '';
    } catch (error) {
      this.statusNode.textContent = '';
      void showErrorMessage(`Could not ${action} ${run.name}`, (error as Error).message);
    }
    await this.refresh();
  }

  async stopEndpoint(name: string): Promise<void> {
    try {
      await this.service.stopEndpoint(name);
    } catch (error) {
      void showErrorMessage(`Could not stop ${name}`, (error as Error).message);
    }
    await this.refresh();
  }

  protected onAfterShow(): void {
    void this.refresh();
    this.startPolling();
  }

  protected onBeforeHide(): void {
    this.stopPolling();
  }

  protected onAfterAttach(): void {
    if (this.isVisible) {
      this.onAfterShow();
    }
  }

  protected onBeforeDetach(): void {
    this.stopPolling();
  }

  dispose(): void {
    this.stopPolling();
    super.dispose();
  }

  private startPolling(): void {
    this.stopPolling();
    this.timer = window.setInterval(() => void this.refresh(), this.intervalMs);
  }

  private stopPolling(): void {
    if (this.timer !== null) {
      window.clearInterval(this.timer);
      this.timer = null;
    }
  }

  private render(reply: IRunsReply): void {
    this.capabilities = reply.capabilities;
    const sweeps = new Map((reply.sweeps ?? []).map(sw => [sw.id, sw]));
    const top: HTMLElement[] = [];
    const trialsOf = new Map<string, RunCard[]>();
    const seen = new Set<string>();
    for (const run of reply.runs) {
      seen.add(run.id);
      let card = this.cards.get(run.id);
      if (card) {
        card.update(run, reply.capabilities);
      } else {
        card = new RunCard(run, this);
        this.cards.set(run.id, card);
      }
      const sweepId = run.sweep?.sweep;
      if (sweepId && sweeps.has(sweepId)) {
        // A sweep sits where its newest trial would (runs come newest first).
        if (!trialsOf.has(sweepId)) {
          trialsOf.set(sweepId, []);
          top.push(this.group(sweeps.get(sweepId)!).node);
        }
        trialsOf.get(sweepId)!.push(card);
      } else {
        top.push(card.node);
      }
    }
    // A sweep that has not started a trial yet is the newest thing there is.
    const waiting = [...sweeps.values()].filter(sw => !trialsOf.has(sw.id));
    top.unshift(...waiting.map(sw => this.group(sw).node));
    for (const [id, group] of this.groups) {
      if (!sweeps.has(id)) {
        this.groups.delete(id);
        continue;
      }
      const cards = (trialsOf.get(id) ?? []).sort(
        (a, b) => (a.run.sweep?.trial ?? 0) - (b.run.sweep?.trial ?? 0)
      );
      placeChildren(group.trials, cards.map(c => c.node));
    }
    placeChildren(this.list, top);
    for (const id of [...this.cards.keys()]) {
      if (!seen.has(id)) {
        this.cards.delete(id);
      }
    }
    if (!reply.runs.length) {
      this.statusNode.textContent = 'No runs yet: launch one from a notebook or with “New run”.';
    }
    this.renderEndpoints(reply.capabilities.endpoints ? reply.endpoints : null);
    this.renderWallet(reply.wallet ?? null, reply.endpoints);
  }

  /** The wallet's balance and holds in one line; what holds and the newest history a click
   * away; an endpoint's credit warning in the line itself. */
  private renderWallet(wallet: IWallet | null, endpoints: IEndpoint[]): void {
    this.walletNode.hidden = wallet === null;
    if (wallet === null) {
      return;
    }
    const amount = (v: number) => `${v.toFixed(2)} ${wallet.currency}`;
    const summary = document.createElement('summary');
    const warnings = endpoints
      .map(e => e.money)
      .filter((m): m is string => !!m && m.startsWith('the wallet covers about') && m.includes('stops'));
    summary.textContent =
      `Credit ${amount(wallet.balance)} left` +
      (wallet.held ? ` · ${amount(wallet.held)} held` : '') +
      ` · ${amount(wallet.charged)} spent of ${amount(wallet.credit)}`;
    this.walletNode.classList.toggle('jp-mod-warning', warnings.length > 0);
    const lines = [
      ...warnings,
      ...wallet.holds.map(h => `held ${amount(h.held)} by ${h.what}`),
      ...wallet.history
        .filter(h => h.kind !== 'release')
        .map(
          h =>
            `${new Date(h.at * 1000).toLocaleString()}  ${h.kind}  ${amount(h.amount)}  ${h.note}`
        )
    ];
    const list = document.createElement('pre');
    list.textContent = lines.join('\n');
    const open = this.walletNode.open;
    this.walletNode.replaceChildren(summary, list);
    this.walletNode.open = open;
  }

  private group(sweep: ISweep): SweepGroup {
    let group = this.groups.get(sweep.id);
    if (group) {
      group.update(sweep);
    } else {
      group = new SweepGroup(sweep);
      this.groups.set(sweep.id, group);
    }
    return group;
  }

  private renderEndpoints(endpoints: IEndpoint[] | null): void {
    this.endpointsSection.hidden = endpoints === null;
    const key = JSON.stringify([endpoints, this.capabilities.stop_endpoint]);
    if (endpoints === null || key === this.endpointsKey) {
      return; // unchanged: keep the nodes (and the keyboard focus on them)
    }
    this.endpointsKey = key;
    this.endpointsList.replaceChildren(
      ...endpoints.map(e => {
        const li = document.createElement('li');
        li.className = 'jp-WorkbenchRuns-endpoint';
        li.dataset.endpoint = e.name;
        const head = document.createElement('div');
        head.className = 'jp-WorkbenchRuns-head';
        const name = document.createElement('span');
        name.className = 'jp-WorkbenchRuns-name';
        name.textContent = e.name;
        const state = document.createElement('span');
        state.className = `jp-WorkbenchRuns-state jp-mod-${e.state === 'healthy' ? 'running' : e.state}`;
        state.textContent = e.state || '?';
        head.append(name, state);
        const meta = document.createElement('div');
        meta.className = 'jp-WorkbenchRuns-meta';
        meta.textContent = [e.target, e.url, e.models.join(', ')].filter(Boolean).join(' · ');
        li.append(head, meta);
        if (e.money) {
          const money = document.createElement('div');
          money.className = 'jp-WorkbenchRuns-money';
          money.textContent = e.money;
          li.append(money);
        }
        if (this.capabilities.stop_endpoint && (e.state === 'starting' || e.state === 'healthy')) {
          const actions = document.createElement('div');
          actions.className = 'jp-WorkbenchRuns-actions';
          actions.append(
            button('Stop', `stop endpoint ${e.name}`, () => void this.stopEndpoint(e.name))
          );
          li.append(actions);
        }
        return li;
      })
    );
    if (!endpoints.length) {
      const li = document.createElement('li');
      li.className = 'jp-WorkbenchRuns-empty';
      li.textContent = 'No endpoints: deploy a finished run.';
      this.endpointsList.append(li);
    }
  }
}
