/**
 * The Workbench JupyterLab plugin: the Runs side panel, run details, the "New fine-tuning run"
 * launcher card and palette entry, and the settings (refresh interval, default target).
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  ICommandPalette,
  MainAreaWidget,
  showErrorMessage
} from '@jupyterlab/apputils';
import { IDefaultFileBrowser } from '@jupyterlab/filebrowser';
import { ILauncher } from '@jupyterlab/launcher';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { LabIcon } from '@jupyterlab/ui-components';

import { RunsCompare } from './compare';
import { RunDetails } from './details';
import { RunsPanel } from './panel';
import { WorkbenchService } from './service';

const PLUGIN_ID = 'workbench-lab:plugin';
const KERNEL_NAME = 'workbench';

namespace CommandIDs {
  export const openPanel = 'workbench:open-panel';
  export const newRun = 'workbench:new-run';
  export const compare = 'workbench:compare-runs';
  export const compareNotebook = 'workbench:compare-notebook';
  export const openDetails = 'workbench:open-details';
}

export const workbenchIcon = new LabIcon({
  name: 'workbench-lab:runs',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" viewBox="0 0 24 24">' +
    '<path class="jp-icon3" fill="#616161" d="M3 3h2v16h16v2H3z"/>' +
    '<path class="jp-icon3" fill="none" stroke="#616161" stroke-width="2" ' +
    'd="M6.5 6.5c2 5 4 8 7 9s5 .5 7-.5"/></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'Workbench runs panel, run details and the New fine-tuning run launcher card.',
  autoStart: true,
  requires: [ISettingRegistry],
  optional: [ILauncher, ICommandPalette, ILayoutRestorer, IDefaultFileBrowser],
  activate: async (
    app: JupyterFrontEnd,
    registry: ISettingRegistry,
    launcher: ILauncher | null,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    fileBrowser: IDefaultFileBrowser | null
  ) => {
    const service = new WorkbenchService();
    const config = { refreshInterval: 2, defaultTarget: 'local' };
    const details = new Map<string, MainAreaWidget<RunDetails>>();

    const panel = new RunsPanel(service, {
      openDetails: run => void app.commands.execute(CommandIDs.openDetails, { id: run.id }),
      openFolder: path =>
        void app.commands.execute('filebrowser:go-to-path', { path: `/${path}` }),
      newRun: () => void app.commands.execute(CommandIDs.newRun),
      compare: (runs: string[]) => void app.commands.execute(CommandIDs.compare, { runs })
    });
    panel.title.icon = workbenchIcon;
    app.shell.add(panel, 'left', { rank: 650 });
    restorer?.add(panel, 'workbench-runs');

    app.commands.addCommand(CommandIDs.openPanel, {
      label: 'Show Workbench Runs',
      caption: 'Open the Workbench runs side panel',
      execute: () => app.shell.activateById(panel.id)
    });

    app.commands.addCommand(CommandIDs.newRun, {
      label: 'New fine-tuning run',
      caption: 'Create a notebook from the Workbench quickstart template',
      icon: args => (args.isLauncher ? workbenchIcon : undefined),
      execute: async args => {
        const cwd = (args.cwd as string) ?? fileBrowser?.model.path ?? '';
        try {
          const { path } = await service.newNotebook(cwd, config.defaultTarget);
          return await app.commands.execute('docmanager:open', {
            path,
            factory: 'Notebook',
            kernel: { name: KERNEL_NAME }
          });
        } catch (error) {
          void showErrorMessage('Could not create the notebook', (error as Error).message);
        }
      }
    });

    app.commands.addCommand(CommandIDs.compare, {
      label: 'Compare runs',
      caption: 'Open the runs selected in the Workbench panel side by side',
      execute: async args => {
        const runs = (args.runs as string[]) ?? [];
        const content = new RunsCompare(service, runs, () => {
          void app.commands.execute(CommandIDs.compareNotebook, { runs });
        });
        const widget = new MainAreaWidget({ content });
        widget.id = content.id;
        widget.title.label = content.title.label;
        widget.title.caption = content.title.caption;
        widget.title.closable = true;
        app.shell.add(widget, 'main');
        app.shell.activateById(widget.id);
        await content.refresh();
      }
    });

    app.commands.addCommand(CommandIDs.compareNotebook, {
      label: 'Compare runs in a notebook',
      caption: 'Open a notebook comparing the runs selected in the Workbench panel',
      execute: async args => {
        const runs = (args.runs as string[]) ?? [];
        try {
          const { path } = await service.compareNotebook(fileBrowser?.model.path ?? '', runs);
          return await app.commands.execute('docmanager:open', {
            path,
            factory: 'Notebook',
            kernel: { name: KERNEL_NAME }
          });
        } catch (error) {
          void showErrorMessage('Could not open the comparison', (error as Error).message);
        }
      }
    });

    app.commands.addCommand(CommandIDs.openDetails, {
      label: args => (args.id ? `Run ${args.id}` : 'Run details'),
      execute: args => {
        const id = String(args.id);
        let widget = details.get(id);
        if (!widget || widget.isDisposed) {
          const content = new RunDetails(service, id, config.refreshInterval * 1000);
          widget = new MainAreaWidget({ content });
          widget.id = `workbench-details-${id}`;
          widget.title.icon = workbenchIcon;
          widget.title.closable = true;
          widget.title.label = id;
          details.set(id, widget);
          widget.disposed.connect(() => details.delete(id));
        }
        if (!widget.isAttached) {
          app.shell.add(widget, 'main');
        } else {
          void widget.content.refresh(); // an ended run's view may have stopped refreshing
        }
        app.shell.activateById(widget.id);
      }
    });

    launcher?.add({ command: CommandIDs.newRun, category: 'Notebook', rank: 0 });
    palette?.addItem({ command: CommandIDs.newRun, category: 'Workbench' });
    palette?.addItem({ command: CommandIDs.openPanel, category: 'Workbench' });

    const apply = (settings: ISettingRegistry.ISettings): void => {
      config.refreshInterval = settings.get('refreshInterval').composite as number;
      config.defaultTarget = settings.get('defaultTarget').composite as string;
      panel.refreshInterval = config.refreshInterval;
      for (const widget of details.values()) {
        widget.content.refreshInterval = config.refreshInterval;
      }
    };
    try {
      const settings = await registry.load(PLUGIN_ID);
      apply(settings);
      settings.changed.connect(apply);
    } catch (error) {
      console.warn('workbench-lab: settings not loaded, using defaults', error);
    }
  }
};

export default plugin;
